"""User-facing errors: raised for bad flags, files or YAML; the CLI prints them as one line, no traceback."""


class SlimeArgError(ValueError):
    """A mistake in the user's input (flag, file, config). The message is one line naming the culprit and the fix."""
