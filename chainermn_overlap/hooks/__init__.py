"""Link and function hooks that report events to the overlapped optimizer.

The hooks decide nothing about communication: they tell the optimizer's
state that a link is about to run, that a parameter's gradient contribution
has arrived, or that a parameter's array is being read by a function.
"""
from chainermn_overlap.hooks.taps import GradTap  # NOQA
from chainermn_overlap.hooks.taps import OverlapLinkHook  # NOQA
from chainermn_overlap.hooks.taps import ParamUseHook  # NOQA

__all__ = ['GradTap', 'OverlapLinkHook', 'ParamUseHook']
