"""The one error type users see: a message that says what is wrong and how to fix it."""


class TvmAttnError(ValueError):
    """Bad input to tvmattn (a spec, a target, a model, a tuning log).

    The CLI prints the message as one line and exits with status 2; library callers catch it like
    any ValueError.
    """
