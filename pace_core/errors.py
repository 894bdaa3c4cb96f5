"""The one error type of pace_core: bad input named by field, with the allowed values."""


class PaceError(ValueError):
    """Raised for invalid settings, files, checkpoints or tensors.

    The message always names the offending field (or file) and what is allowed, so the CLI and
    the app can show it to the user as is.
    """
