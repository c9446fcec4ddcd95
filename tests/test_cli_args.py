"""Comma-separated list arguments (dspark/cli_args.py): what `dspark bench` and `dspark eval` parse.

Specification: items are split on commas with blanks and empty items dropped; a list that does
not parse makes argparse exit 2 with a message quoting what was given."""

from __future__ import annotations

import argparse

import pytest

from dspark.cli_args import comma_floats, comma_ints, comma_names


def test_lists_parse_item_by_item_and_skip_empty_items():
    assert comma_floats("0, 0.5,1,") == (0.0, 0.5, 1.0)
    assert comma_ints("1,,2,4") == (1, 2, 4)
    assert comma_names(" none, fixed:7 ,,dspark ") == ("none", "fixed:7", "dspark")
    assert comma_floats("") == comma_ints("") == comma_names("") == ()


@pytest.mark.parametrize("arg_type, text, message", [
    (comma_floats, "0,hot", "expected comma-separated numbers, got '0,hot'"),
    (comma_ints, "1,2.5", "expected comma-separated integers, got '1,2.5'"),
])
def test_a_list_that_does_not_parse_is_an_argparse_error_quoting_it(capsys, arg_type, text, message):
    parser = argparse.ArgumentParser()
    parser.add_argument("--values", type=arg_type)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--values", text])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
