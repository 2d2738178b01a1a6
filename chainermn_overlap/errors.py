"""Warning and error classes of the library."""


class FallbackWarning(UserWarning):
    """The requested overlap could not be used; a safe fallback is used.

    For example an optimizer hook that needs every gradient at once (such
    as ``GradientClipping``) makes ``wait='forward'`` wait in ``update()``.
    """
