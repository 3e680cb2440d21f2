"""JSON values as the contract compares them: objects regardless of member order, numbers by
numeric value (1 equals 1.0, 9007199254740993 does not equal 9007199254740992.0), booleans
never equal to numbers. `canon` maps a parsed value to a string that is equal for exactly the
values the contract calls equal, so the validators compare and hash values as strings."""

import json

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False).encode


def _norm(v):
    t = type(v)
    if t is float:
        # An integral double equals the integer of the same value (Python's int/float
        # comparison is exact, so 2**53 + 1 stays apart from 2.0**53).
        if v.is_integer():
            return int(v)
        return v
    if t is dict:
        return {k: _norm(x) for k, x in v.items()}
    if t is list:
        return [_norm(x) for x in v]
    return v


def canon(v):
    """The canonical text of a parsed JSON value (equal texts iff equal values)."""
    t = type(v)
    if t is str:
        return _dumps(v)
    if t is int or v is None or t is bool:
        return _dumps(v)
    return _dumps(_norm(v))


ABSENT = None  # a key that does not exist (canon never returns None)
