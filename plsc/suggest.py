"""The "did you mean" of every name a user picks from a list (config keys and sections, model
names, choices, kernel sets): one spelling of the hint. No Paddle import (the config reads it)."""
import difflib

__all__ = ["closest", "did_you_mean"]


def closest(name, options, cutoff=0.5):
    """The option most like `name` (compared in lower case), or None below `cutoff`."""
    by_lower = {str(option).lower(): option for option in options}
    close = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[close[0]] if close else None


def did_you_mean(name, options, cutoff=0.5, listed=True, shown=None):
    """"; did you mean 'X'?" for the option closest to `name` (`shown[X]` in its place when
    given), else "; valid: a, b, c" ("" when `listed` is False: the caller lists them)."""
    close = closest(name, options, cutoff)
    if close is not None:
        return f"; did you mean {(shown or {}).get(close, close)!r}?"
    return f"; valid: {', '.join(options)}" if listed else ""
