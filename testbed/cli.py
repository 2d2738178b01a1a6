"""The test bed's command line: an MPI program over shaped links.

Run (as root)::

    python -m testbed.netbed --ranks 2 --rate 400mbit --probe
    python -m testbed.netbed --ranks 2 --rate 400mbit [--delay 0.2ms] \\
        [--timeout 600] [--record bed.json] -- python my_mpi_script.py ARGS

(``python -m testbed`` is the same.)  See :mod:`testbed.netbed` for what
the bed builds.
"""
import argparse
import json
import sys

from testbed import netbed, probe


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = []
    if '--' in argv:
        i = argv.index('--')
        argv, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(
        description='Run an MPI program with one rank per network namespace '
                    'over a tc-shaped link (needs root).')
    p.add_argument('--ranks', type=int, default=2)
    p.add_argument('--rate', default='400mbit',
                   help='link rate per rank and direction (tc tbf)')
    p.add_argument('--delay', default=None,
                   help='one-way link delay, e.g. 0.2ms (default: none)')
    p.add_argument('--delay-method', choices=netbed.DELAY_METHODS,
                   default=None,
                   help='netem, or the relay of testbed/netrelay.py '
                        '(default: netem where the kernel has it)')
    p.add_argument('--timeout', type=float, default=600,
                   help='seconds before the MPI job is killed')
    p.add_argument('--probe', action='store_true',
                   help='measure allreduce bandwidth instead of running CMD')
    p.add_argument('--probe-bytes', type=int, default=16 * 2 ** 20)
    p.add_argument('--record', default=None,
                   help='write the bed description (and probe) as JSON')
    args = p.parse_args(argv)
    if not cmd and not args.probe:
        p.error('give --probe or a command after --')
    netbed.require_root()
    try:
        return _main(args, cmd)
    except KeyboardInterrupt:
        sys.stderr.write('netbed: interrupted; its namespaces were removed\n')
        return 130
    except netbed.NetBedError as e:
        sys.stderr.write('netbed: {}\n'.format(e))
        return 1


def _main(args, cmd):
    record = {}
    with netbed.NetBed(args.ranks, args.rate, args.delay,
                       delay_method=args.delay_method) as bed:
        record['bed'] = bed.describe()
        print('netbed: {} ranks, {} at {:.0f} Mbit/s{}, RTT {:.3f} ms, '
              'namespaces {}, pinned to cores {}'.format(
                  bed.ranks, record['bed']['topology'], bed.rate_bps / 1e6,
                  ', delay {:g} ms ({})'.format(bed.delay_s * 1e3,
                                                bed.delay_method)
                  if bed.delay_s else '', bed.rtt['median_s'] * 1e3,
                  ' '.join(bed.namespaces), bed.pinning()))
        if args.probe:
            pr = probe.probe(bed, args.probe_bytes, timeout=args.timeout)
            record['probe'] = pr
            print('netbed: allreduce of {:.1f} MB: {:.0f} Mbit/s (bus '
                  'bandwidth, configured {:.0f} Mbit/s)'.format(
                      pr['bytes'] / 1e6, pr['busbw_bit_per_s'] / 1e6,
                      bed.rate_bps / 1e6))
            rc = 0
        else:
            res = bed.run_mpi(cmd, timeout=args.timeout, capture=False)
            record['run'] = {k: res[k] for k in ('returncode', 'seconds',
                                                 'command')}
            rc = res['returncode']
    record['relay_stats'] = bed.relay_stats
    record['namespaces_left'] = [n for n in netbed.list_namespaces()
                                 if n in record['bed']['namespaces']]
    if args.record:
        with open(args.record, 'w') as f:
            json.dump(record, f, indent=2)
    return rc


if __name__ == '__main__':
    sys.exit(main())
