"""compat's promise on a torch it was not checked on: a function entry whose torch internals are
gone or changed raises `compat.Unsupported` naming the feature and the installed version (never an
AttributeError from inside a rank), while on a checked torch the entry is the function itself."""

from __future__ import annotations

import inspect

import pytest
import torch

from fleetwise import compat


def test_an_entry_on_an_unchecked_torch_says_which_feature_and_version():
    def reads_a_gone_internal(x):
        return x._gone_in_this_release

    def changed_signature(x):
        return torch.zeros(1, no_such_argument=x)

    def user_error(x):
        raise ValueError("not torch's doing")

    unchecked = ("9.98", "9.99")
    for fn in (reads_a_gone_internal, changed_signature):
        guarded = compat._entry("the feature", unchecked)(fn)
        with pytest.raises(compat.Unsupported) as err:
            guarded(1)
        msg = str(err.value)
        assert "the feature" in msg and torch.__version__ in msg and "9.98, 9.99" in msg, msg
        assert isinstance(err.value.__cause__, (AttributeError, TypeError))
    with pytest.raises(ValueError):  # anything else is not a version difference: it passes through
        compat._entry("the feature", unchecked)(user_error)(1)


def test_on_the_checked_torch_entries_are_the_functions_themselves():
    assert compat.MINOR in compat.TESTED
    fn = lambda: None  # noqa: E731
    assert compat._entry("the feature")(fn) is fn  # no wrapper: no cost on the hot paths
    for name in ("storage_key", "local_tensor", "set_last_lr", "flatten_mesh", "load_into_empty"):
        entry = getattr(compat, name)
        assert "guarded" not in entry.__qualname__ and inspect.getmodule(entry) is compat, name


def test_a_half_written_error_file_is_reported_without_it(tmp_path):
    """A rank killed while writing its error file (torch terminates a failed group's other ranks as
    the report is made) leaves it empty or cut: the agent reports that rank by its exit code alone
    instead of crashing on the JSON (seen once: the crash ended a job that was to be restarted)."""
    from torch.distributed.elastic.multiprocessing import api

    from fleetwise.compat import _readable_error_file

    whole, cut, empty = tmp_path / "whole.json", tmp_path / "cut.json", tmp_path / "empty.json"
    whole.write_text('{"message": {"message": "RuntimeError: boom", "extraInfo": {"timestamp": "1"}}}')
    cut.write_text('{"message": {"mess')
    empty.write_text("")
    missing = str(tmp_path / "missing.json")
    assert [_readable_error_file(str(p)) for p in (whole, cut, empty)] == [str(whole), "", ""]
    assert _readable_error_file(missing) == missing
    failure = api.ProcessFailure(local_rank=1, pid=1, exitcode=-15, error_file=_readable_error_file(str(cut)))
    assert failure.exitcode == -15 and "SIGTERM" in failure.message
