"""Sizes, rates and counts: one grammar for every flag, errors naming the flag and the text."""
from __future__ import annotations

import pytest

from megatron_mlp.errors import ConfigError
from megatron_mlp.units import format_count, format_size, human_bytes, human_seconds, parse_count, parse_rate, parse_size


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("200GB", 200 * 10**9), ("1.5GiB", 3 << 29), ("8MiB", 8 << 20), ("8 mib", 8 << 20),
    ("2TB", 2 * 10**12), ("0", 0)])
def test_size_accepts_decimal_and_binary_units(text, expected):
    assert parse_size(text, "--x") == expected


@pytest.mark.parametrize("text", ["", "8 bananas", "-1", "GB", "1e9"])
def test_size_that_is_not_one_names_the_flag_and_the_text(text):
    with pytest.raises(ConfigError, match=f"--some-flag: cannot parse size {text!r}"):
        parse_size(text, "--some-flag")


def test_rate_takes_an_optional_per_second_and_must_be_positive():
    assert parse_rate("6GB/s", "--x") == parse_rate("6GB", "--x") == 6e9
    with pytest.raises(ConfigError, match="--x: bandwidth '0GB/s' must be positive"):
        parse_rate("0GB/s", "--x")


@pytest.mark.parametrize("text,expected", [
    # what both former grammars (the flag's and `megatron-mlp plan`'s) accepted
    ("100M", 100_000_000), ("1.5B", 1_500_000_000), ("25000000", 25_000_000), ("2.5e7", 25_000_000),
    ("4k", 4000), ("7B", 7_000_000_000), ("7b", 7_000_000_000), ("2G", 2_000_000_000), (" 100 m ", 100_000_000),
    # what one of them accepted
    ("3T", 3 * 10**12), ("5e-1k", 500), ("1.", 1), (".5k", 500), ("+5", 5), (25_000_000, 25_000_000),
    # exact, not through a float
    ("1.1B", 1_100_000_000), ("0.3k", 300)])
def test_count_accepts_decimal_units_exponents_and_ints(text, expected):
    assert parse_count(text, "--x") == expected


@pytest.mark.parametrize("text,message", [
    ("lots", "cannot parse count 'lots'"), ("-1", "cannot parse count '-1'"), ("nan", "cannot parse count 'nan'"),
    ("inf", "cannot parse count 'inf'"), ("1_000", "cannot parse count '1_000'"), ("", "cannot parse count ''"),
    ("1.5", "'1.5' is not a whole count"), ("2.7", "'2.7' is not a whole count"),
    ("0", "'0' must be a count of at least 1"), (0, "0 must be a count of at least 1"),
    ("1e19", "'1e19' is larger than"), ("1e999999999999999999999", "is larger than"), (True, "True is not a count")])
def test_count_that_is_not_a_whole_positive_count_names_the_flag_and_the_text(text, message):
    with pytest.raises(ConfigError) as info:
        parse_count(text, "--num-params")
    assert str(info.value).startswith("--num-params: ") and message in str(info.value)


@pytest.mark.parametrize("value,text", [(100_000_000, "100M"), (4096, "4096"), (1500, "1500"), (7 * 10**9, "7B"),
                                        (3 * 10**12, "3T"), (2000, "2k")])
def test_count_is_formatted_exactly_and_parses_back(value, text):
    assert format_count(value) == text and parse_count(text, "--x") == value


@pytest.mark.parametrize("value,text", [(8 << 20, "8MiB"), (0, "0"), (8 * 10**9, "8GB"), (4096, "4KiB"),
                                        (1 << 40, "1TiB"), (12345, "12345")])
def test_size_is_formatted_exactly_and_parses_back(value, text):
    assert format_size(value) == text and parse_size(text, "--x") == value


@pytest.mark.parametrize("value,text", [(0, "0 B"), (999, "999 B"), (1234567, "1.23 MB"), (2.4e9, "2.40 GB"),
                                        (3e12, "3.00 TB")])
def test_human_bytes_rounds_to_decimal_units(value, text):
    assert human_bytes(value) == text


@pytest.mark.parametrize("value,text", [(0, "0 s"), (2.5e-5, "25.0 us"), (0.0123, "12.3 ms"), (4, "4.000 s")])
def test_human_seconds_picks_the_unit_that_reads_best(value, text):
    assert human_seconds(value) == text
