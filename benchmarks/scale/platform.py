"""The SimGrid platform of the replay (:mod:`benchmarks.scale.replay`).

Standard library only: the replay runs under the system Python and loads
this file by path.
"""
import math

TOPOLOGIES = ('star', 'fat_tree')


def platform_xml(hosts, rate_bit_per_s, latency_s, topology='star',
                 efficiency=1.0):
    """SimGrid platform (XML, version 4.1) of ``hosts`` ranks.

    ``latency_s`` is the one-way host-to-host latency; a path crosses two
    host links (``star``) or, in the fat-tree, up to four, so each link of
    a star carries half of it and each fat-tree link a quarter (so that the
    farthest pair sees ``latency_s``).
    """
    if hosts < 1:
        raise ValueError('a platform needs at least one host')
    if topology not in TOPOLOGIES:
        raise ValueError('topology must be one of {}, got {!r}'.format(
            TOPOLOGIES, topology))
    bw = '{!r}Bps'.format(rate_bit_per_s * efficiency / 8.0)
    head = ("<?xml version='1.0'?>\n<!DOCTYPE platform SYSTEM "
            "\"https://simgrid.org/simgrid.dtd\">\n<platform version=\"4.1\">"
            "\n")
    if topology == 'star':
        lat = '{!r}s'.format(latency_s / 2.0)
        body = (' <cluster id="ranks" prefix="h" suffix="" radical="0-{}" '
                'speed="1f" bw="{}" lat="{}" bb_bw="1e15Bps" bb_lat="0s" '
                'sharing_policy="SPLITDUPLEX" bb_sharing_policy="FATPIPE"/>\n'
                .format(hosts - 1, bw, lat))
    else:
        # Two levels, full bisection: leaves of `down` hosts, each leaf
        # with `down` uplinks to as many spines.
        down = max(1, int(math.ceil(math.sqrt(hosts))))
        leaves = int(math.ceil(hosts / down))
        lat = '{!r}s'.format(latency_s / 4.0)
        body = (' <cluster id="ranks" prefix="h" suffix="" radical="0-{}" '
                'speed="1f" bw="{}" lat="{}" topology="FAT_TREE" '
                'topo_parameters="2;{},{};1,{};1,1" '
                'sharing_policy="SPLITDUPLEX"/>\n'.format(
                    leaves * down - 1, bw, lat, down, leaves, down))
    return head + body + '</platform>\n'
