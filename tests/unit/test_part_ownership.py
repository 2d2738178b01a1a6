"""The optimizer's parts are finished by their own constructors.

No module of the package assigns a field of the bucket reducer, the
gradient tracker or an update policy from outside its own class: each
mode builds them whole (``optimizers/_modes.py``), and a part changes its
own state through its own methods.  The check reads the source (AST).

What counts as "a part" in an assignment ``X.attr = ...`` (also ``+=``,
``del`` and ``setattr(X, ...)``):

* ``X`` is ``<anything>.reducer``, ``.tracker``, ``.policy`` or
  ``.shard_params`` (the tracker's name for the policy);
* ``X`` is a name called ``reducer``, ``tracker`` or ``policy`` (a
  parameter, as in the sharding helpers that take the policy);
* ``X`` is a name bound in the same function from such an expression, by
  assignment, tuple unpacking, a ``for`` over ``.reducers``/``policies``
  (or a comprehension), or from ``shards.policy_of(...)``.

Inside the parts' own classes ``self.attr = ...`` is theirs to do.
"""
import ast
import os
import subprocess

import pytest

import chainermn_overlap

PACKAGE = os.path.dirname(chainermn_overlap.__file__)
ROOT = os.path.dirname(PACKAGE)

PARTS = {'reducer', 'tracker', 'policy', 'shard_params'}
PLURALS = {'reducers', 'policies', 'trackers'}
PART_FACTORIES = {'policy_of'}


def _is_part(node, bound):
    """Whether the expression ``node`` evaluates to a part."""
    if isinstance(node, ast.Attribute):
        return node.attr in PARTS
    if isinstance(node, ast.Name):
        return node.id in PARTS or node.id in bound
    if isinstance(node, ast.Subscript):
        return _is_plural(node.value)
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(
            f, 'id', None)
        return name in PART_FACTORIES
    return False


def _is_plural(node):
    if isinstance(node, ast.Attribute):
        return node.attr in PLURALS
    if isinstance(node, ast.Name):
        return node.id in PLURALS
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
        return _is_part(node.elt, set())
    if isinstance(node, ast.Call) and getattr(node.func, 'id', None) in (
            'list', 'map', 'filter', 'reversed', 'sorted'):
        return any(_is_plural(a) or _is_part(a, set()) for a in node.args)
    return False


def _targets(node):
    if isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _bind(target, value, bound):
    """Names of ``target`` bound to parts by ``target = value``."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(
            value, (ast.Tuple, ast.List)) and len(target.elts) == len(
                value.elts):
        for t, v in zip(target.elts, value.elts):
            _bind(t, v, bound)
    elif isinstance(target, ast.Name) and _is_part(value, bound):
        bound.add(target.id)


class _Checker(ast.NodeVisitor):

    def __init__(self, path):
        self.path = path
        self.found = []
        self.bound = [set()]

    def _report(self, node, what):
        self.found.append('{}:{}: {}'.format(
            os.path.relpath(self.path, ROOT), node.lineno, what))

    def _function(self, node):
        self.bound.append(set())
        self.generic_visit(node)
        self.bound.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _check_target(self, target):
        for t in _targets(target):
            if isinstance(t, ast.Attribute) and _is_part(t.value,
                                                         self.bound[-1]):
                self._report(t, 'assigns {} of a part from outside its '
                             'class'.format(ast.unparse(t)))

    def visit_Assign(self, node):
        for target in node.targets:
            self._check_target(target)
            _bind(target, node.value, self.bound[-1])
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._check_target(node.target)
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Delete(self, node):
        for target in node.targets:
            self._check_target(target)
        self.generic_visit(node)

    def _loop(self, target, iterable):
        if _is_plural(iterable):
            for t in _targets(target):
                if isinstance(t, ast.Name):
                    self.bound[-1].add(t.id)

    def visit_For(self, node):
        self._loop(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node):
        self._loop(node.target, node.iter)
        self.generic_visit(node)

    def visit_withitem(self, node):
        if node.optional_vars is not None:
            _bind(node.optional_vars, node.context_expr, self.bound[-1])
        self.generic_visit(node)

    def visit_Call(self, node):
        if (getattr(node.func, 'id', None) in ('setattr', 'delattr')
                and node.args and _is_part(node.args[0], self.bound[-1])):
            self._report(node, '{} on a part from outside its class'
                         .format(node.func.id))
        self.generic_visit(node)


def violations_in_source(source, path='<source>'):
    checker = _Checker(path)
    checker.visit(ast.parse(source))
    return checker.found


def violations(package_dir):
    found = []
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if d != '__pycache__']
        for name in sorted(filenames):
            if name.endswith('.py'):
                path = os.path.join(dirpath, name)
                with open(path, encoding='utf-8') as f:
                    found += violations_in_source(f.read(), path)
    return found


def test_no_part_field_is_assigned_from_outside():
    assert violations(PACKAGE) == []


@pytest.mark.parametrize('snippet', [
    # The wiring finishing the reducer (as _OverlapState once did).
    'def f(self):\n    self.reducer.transient = True',
    # Through a local name, incremented.
    'def f(self):\n    tracker = self._overlap.tracker\n'
    '    tracker.no_sync_depth += 1',
    # A helper given the policy as a parameter.
    'def f(policy):\n    policy.states_sharded = False',
    # A loop over several parts.
    'def f(self):\n    for r in self.reducers:\n        r.engine = None',
    'def f(opts):\n    for p in [policy_of(o) for o in opts]:\n'
    '        p.save_shards = True',
    'def f(self):\n    setattr(self.policy, "in_flight", 3)',
    'def f(self):\n    a, tracker = 1, self.tracker\n'
    '    tracker.release_grads = True',
])
def test_the_check_finds_an_assignment_from_outside(snippet):
    assert len(violations_in_source(snippet)) == 1, snippet


@pytest.mark.parametrize('snippet', [
    # A part's own fields, in its own methods.
    'class BucketReducer:\n    def f(self):\n        self.engine = None',
    # Reading a part's field, or changing other objects' fields.
    'def f(self):\n    x = self.policy.in_flight\n    self.layout.y = x',
    'def f(self):\n    bucket = self.reducer.buckets[0]\n'
    '    bucket.handle = None',
])
def test_the_check_allows_reads_and_own_fields(snippet):
    assert violations_in_source(snippet) == []


def test_the_check_fails_on_the_tree_before_the_modes():
    """Negative control: the commit before the parts were built whole
    assigned their fields from outside (``_OverlapState.__init__``,
    ``attach``, ``no_sync``, the sharding helpers)."""
    git = ['git', '-C', ROOT]
    old = '6d772b5'
    try:
        sources = subprocess.run(
            git + ['ls-tree', '-r', '--name-only', old, 'chainermn_overlap'],
            check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip('not a git checkout with its history')
    found = []
    for path in sources:
        if path.endswith('.py'):
            text = subprocess.run(git + ['show', '{}:{}'.format(old, path)],
                                  check=True, capture_output=True,
                                  text=True).stdout
            found += violations_in_source(text, os.path.join(ROOT, path))
    joined = '\n'.join(found)
    for expected in ('self.reducer.items_per_bucket',
                     'self.reducer.engine', 'tracker.no_sync_depth',
                     'policy.states_sharded', 'r.engine',
                     'p.save_shards'):
        assert expected in joined, (expected, joined)
