"""What every multi-node optimizer wrapper of this library shares."""


class OptimizerWrapper(object):
    """Delegates to the actual optimizer; keeps its own state in one object.

    ChainerMN's wrappers delegate with ``__getattr__``/``__setattr__`` and
    then need ``super().__setattr__`` for each field of their own; keeping
    all of the wrapper's own state in one object avoids that.

    Args:
        state: the wrapper's state; must have ``actual`` (the wrapped
            optimizer) and ``communicator``.
    """

    def __init__(self, state):
        object.__setattr__(self, '_state', state)

    @property
    def actual_optimizer(self):
        return self._state.actual

    @property
    def communicator(self):
        return self._state.communicator

    def __getattr__(self, name):
        if name == '_state':  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self._state.actual, name)

    def __setattr__(self, name, value):
        setattr(self._state.actual, name, value)
