"""The one error type users see: a one-line message and exit code 2 from the CLI."""


class DecodertError(Exception):
    """A user-facing failure: bad input, missing file, unsupported model.

    The CLI prints ``decodert: error: <message>`` on one line and exits with code 2.
    Keep messages one line and name the file or setting involved.
    """

    exit_code = 2


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during work that cleans up after itself (an export's temp folder), raised in the
    main thread as SIGINT raises KeyboardInterrupt, so the same cleanup runs. The CLI prints one line and
    exits 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class MissingDependencyError(DecodertError):
    """A package decodert needs is not installed: the installation's fault, not the input's (the
    server answers 500, not 400). The message names the package and how to install it."""


class Busy(DecodertError):
    """What a request needs is taken by others right now (e.g. every image-fetch place): retry later (a server
    answers 503 with Retry-After, not 400: the request is not at fault)."""


class DamagedState(DecodertError):
    """A state file (a prefix-cache block, a saved session: runtime/persist/records.py) that cannot be used: truncated,
    failing its checksum, of another artifact, adapter or format version. The message names the file and what is
    wrong; nothing of it was loaded."""


class RequestError(DecodertError):
    """A request that cannot be run, with the part of it at fault (``param``: "messages", "tools", "prompt",
    ...), which a server reports beside the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def first_line(e: BaseException) -> str:
    """The first line of a third-party exception's message ('' if it has none), to quote in a
    one-line DecodertError."""
    return (str(e).strip().splitlines() or [""])[0]
