"""``python -m benchmarks``: list the studies, or run one with its options.

Usage::

    python -m benchmarks --list
    python -m benchmarks NAME [the study's own options]

The study's options are its own (``python -m benchmarks NAME --help``);
the studies are in :mod:`benchmarks.harness.registry`.
"""
import sys

from benchmarks.harness import registry

USAGE = ('usage: python -m benchmarks --list\n'
         '       python -m benchmarks NAME [the study\'s options]\n')


def main(argv=None):
    """Entry point; returns the exit status (2 for a wrong command line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.stderr.write(USAGE + 'benchmarks: give --list or a study\'s '
                         'name\n')
        return 2
    if argv[0] in ('-h', '--help'):
        sys.stdout.write(USAGE + '\nstudies:\n')
    if argv[0] in ('--list', '-h', '--help'):
        for line in registry.listing():
            sys.stdout.write(line + '\n')
        return 0
    if argv[0].startswith('-'):
        sys.stderr.write(USAGE + 'benchmarks: unknown option {}\n'.format(
            argv[0]))
        return 2
    try:
        registry.module_of(argv[0])
    except registry.UnknownStudy:
        sys.stderr.write('benchmarks: no study named {!r}; `python -m '
                         'benchmarks --list` lists them\n'.format(argv[0]))
        return 2
    registry.run(argv[0], argv[1:])
    return 0


if __name__ == '__main__':
    sys.exit(main())
