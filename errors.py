"""The one error type users see: a one-line message and exit code 2 from the CLI."""


class DecodertError(Exception):
    """A user-facing failure: bad input, missing file, unsupported model.

    The CLI prints ``decodert: error: <message>`` on one line and exits with code 2.
    Keep messages one line and name the file or setting involved.
    """

    exit_code = 2
