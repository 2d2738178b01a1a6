"""Which hosts and how many ranks the next attempt runs on.

Pure policy, no processes: :class:`HostPolicy` turns the listed hosts and
which of them answered into an allocation, and after a failed attempt
decides what to leave out next time:

* a host that does not answer is left out of the attempt (it is taken back
  at a later attempt once it answers again);
* after ``shrink_after`` attempts in a row without progress, the next runs
  smaller: without the whole host when the failure was the host's (its
  ranks all ended on their own, or it vanished with its processes), else
  one rank fewer (taken from the last host);
* what the shrinking left out is taken back once an attempt makes
  progress (writes a snapshot) and ends, i.e. at the next restart;
* never fewer than ``min_hosts`` hosts or ``min_ranks`` ranks: an attempt
  that cannot have them does not start (and counts as a failed attempt).

Without hosts (one machine) the same rules apply to ranks alone.
"""

from chainermn_overlap.launch._hosts import allocate

__all__ = ['HostPolicy']


class HostPolicy(object):
    """The shrinking and growing rules of the launcher (see the module).

    Args:
        ranks (int): ranks wanted (at most the listed slots are used).
        min_ranks (int): fewest ranks to run on.
        min_hosts (int): fewest hosts to run on (hosts mode).
        shrink_after (int): attempts in a row without progress before
            the next one runs smaller.
    """

    def __init__(self, ranks, min_ranks, min_hosts=1, shrink_after=2):
        self.ranks = ranks
        self.min_ranks = min_ranks
        self.min_hosts = min_hosts
        self.shrink_after = max(1, shrink_after)
        self.dropped = set()        # hosts left out by shrinking
        self.cut = 0                # ranks left out by shrinking
        self.failures = 0           # attempts in a row without progress

    def plan(self, hosts, verdicts):
        """The next attempt's ``[(host, ranks)]``, or why it cannot run.

        Args:
            hosts (list of tuple): ``(host, slots)`` listed now.
            verdicts (dict): host -> None (answered) or why not.

        Returns:
            tuple: ``(allocation, None)`` or ``(None, reason)``.
        """
        usable = [(h, s) for h, s in hosts
                  if verdicts.get(h) is None and h not in self.dropped]
        slots = sum(s for _, s in usable)
        size = min(self.ranks, slots) - self.cut
        if len(usable) < self.min_hosts or size < self.min_ranks:
            missing = ['{} ({})'.format(h, verdicts[h]) for h, _ in hosts
                       if verdicts.get(h) is not None]
            missing += ['{} (left out after failures)'.format(h)
                        for h in sorted(self.dropped)]
            return None, (
                '{} usable host(s) with {} rank(s), fewer than --min-hosts '
                '{} / --min-ranks {}{}'.format(
                    len(usable), max(size, 0), self.min_hosts,
                    self.min_ranks, '; not usable: ' + ', '.join(missing)
                    if missing else ''))
        return allocate(usable, size), None

    def local_size(self):
        """Ranks of the next attempt on one machine."""
        return self.ranks - self.cut

    def after(self, result, allocation=None):
        """Updates the rules after a failed attempt; says what changed.

        Args:
            result (AttemptResult): the attempt.
            allocation (list of tuple): its ``[(host, ranks)]``, or None.

        Returns:
            str: why the next attempt is smaller, or '' when it is not.
        """
        if result.progressed:
            self.failures = 0
            self.dropped.clear()
            self.cut = 0
            return ''
        self.failures += 1
        if self.failures < self.shrink_after:
            return ''
        size = sum(n for _, n in allocation) if allocation else result.size
        host = failed_host(result, allocation) if allocation else None
        if host is not None and len(allocation) - 1 >= self.min_hosts and \
                size - dict(allocation)[host] >= self.min_ranks:
            self.dropped.add(host)
            self.failures = 0
            return ('without host {}: {} attempt(s) in a row made no '
                    'progress and its ranks all ended there'.format(
                        host, self.shrink_after))
        if size - 1 >= self.min_ranks and (
                not allocation or len(allocation) > self.min_hosts
                or allocation[-1][1] > 1):
            self.cut += 1
            self.failures = 0
            return 'fewer: {} attempt(s) in a row made no progress'.format(
                self.shrink_after)
        return ''


def failed_host(result, allocation):
    """The host whose failure ended the attempt, when it was the host's.

    The host of the first rank that ended on its own (not by a signal the
    process manager passed on), or the one mpiexec names; it counts when
    none of its ranks was ended from outside and either all of them
    reported their end or none could (the host went away with them).
    """
    death = result.facts.get('first_death')
    host = death.get('host') if death and not death.get('forwarded') \
        else None
    for fact, at in (('session_lost', 0), ('bad_pid', 1), ('ssh_closed', 0)):
        if host is None and fact in result.facts:
            host = result.facts[fact][at]
    ranks = dict(allocation)
    if host not in ranks:
        return None
    own = [d for d in result.output.deaths if d.get('host') == host]
    if any(d.get('forwarded') for d in own):
        return None
    if own and len(own) != ranks[host]:
        return None
    return host
