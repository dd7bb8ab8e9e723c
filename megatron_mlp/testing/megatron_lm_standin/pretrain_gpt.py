"""Stand-in for Megatron-LM's pretrain_gpt.py: parse arguments, train, save (see README.md)."""
from megatron.training import pretrain

if __name__ == "__main__":
    pretrain()
