"""Warning and error classes of the library."""

__all__ = ['CollectiveMismatchError', 'CommunicationError',
           'CommunicationTimeout', 'FallbackWarning', 'StallWarning']


class FallbackWarning(UserWarning):
    """The requested overlap could not be used; a safe fallback is used.

    For example an optimizer hook that needs every gradient at once (such
    as ``GradientClipping``) makes ``wait='forward'`` wait in ``update()``.
    """


class CommunicationError(RuntimeError):
    """A posted reduction failed; raised where it is waited for."""


class CommunicationTimeout(CommunicationError):
    """A reduction did not complete within the watchdog's timeout.

    The message names the pending communication (bucket, parameters,
    bytes, how long it was waited for).  The communication thread is still
    inside the collective, so the job cannot continue; at exit the library
    calls ``MPI_Abort`` rather than hang in ``MPI_Finalize``.
    """


class CollectiveMismatchError(CommunicationError):
    """Ranks disagree on the sequence of collectives (which, in what order).

    Raised on every rank, naming the ranks that disagree.  Continuing would
    reduce unrelated data together or hang.
    """


class StallWarning(UserWarning):
    """A rank has waited longer than the stall threshold for a reduction.

    Issued by the stall diagnosis mode (``CHAINERMN_OVERLAP_STALL_WARNING``
    or the optimizer's ``stall_warning`` option); the message says which
    ranks have not posted which bucket.
    """
