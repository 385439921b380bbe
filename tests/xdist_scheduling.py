"""The suite's xdist scheduler: whole modules per worker, and a worker crash that ends in a
report instead of a hang.

Under ``-n 3`` (the README's test command: three workers on CI's two cores, because the SLURM
tests and process start-ups leave a core idle much of the time) the workers take whole modules,
so a module-scoped fixture (a trained checkpoint, a set of launched runs) is built on one worker
only. The SLURM modules share one local cluster (a session fixture) and spend most of their time
waiting on it (a real time limit, requeue, accounting): they form one unit, scheduled first, so
that their waiting overlaps the rest of the suite and no two SLURM tests ever compete for the
one-node cluster. (xdist's own ``loadgroup`` marks do not group with pytest 9.2, whose node ids no
longer follow the ``_nodeid`` attribute xdist 3.8 rewrites; this scheduler groups by module.)

Units are handed out in collection order, which conftest.py sorts longest module first (the
seconds each took in a full run, tests/module_durations.json): a long module started last is the
tail that keeps one worker busy while the others are done. xdist's default reorders units by
their number of tests instead, which put the few-test SLURM unit near the end; it is turned off.

xdist 3.8's scope scheduler, which this one extends, hangs the whole session when a worker dies
(a segfault in a test, the OOM killer): it puts every unit the dead worker ever held back on the
queue, finished ones included, and a replacement worker handed an empty unit, or a single test,
waits forever for a next test that never comes. A CI run was stopped at its 90-minute limit that
way. Here the crashed test is reported failed once (xdist does that) and not run again, only the
dead worker's unfinished tests go back on the queue, and a worker is always left either with two
tests to go or told that nothing more is coming, so it never waits on its last test.
"""

from __future__ import annotations

from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

SLURM_MODULES = {"test_slurm.py", "test_slurm_requeue.py"}


class ModuleScheduling(LoadScopeScheduling):
    def __init__(self, config, log=None) -> None:
        config.option.loadscopereorder = False  # keep the longest-first collection order
        super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return "slurm" if Path(module).name in SLURM_MODULES else module

    def remove_node(self, node) -> str | None:
        workload = self.assigned_work.pop(node)
        pending = {scope: {nodeid: False for nodeid, done in unit.items() if not done}
                   for scope, unit in workload.items()}
        pending = {scope: unit for scope, unit in pending.items() if unit}
        if not pending:
            return None  # a clean shutdown, or a crash after its last test
        # The worker runs its tests in the order they were sent: the first unfinished one is the
        # test it died in. xdist reports it failed; it goes back on the queue with the rest but
        # marked done, so that no replacement worker dies on it again.
        crash_scope = next(iter(pending))
        crashitem = next(iter(pending[crash_scope]))
        del pending[crash_scope][crashitem]
        pending = {scope: unit for scope, unit in pending.items() if unit}
        for scope, unit in pending.items():
            self.workqueue[scope] = unit
            self.workqueue.move_to_end(scope, last=False)  # resume them before fresh modules
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        try:
            self._top_up(node)
        except OSError:
            # The worker died after reporting its last test and before this send ("cannot send
            # (already closed?)"): what was just assigned to it is in assigned_work, unfinished,
            # and remove_node puts it back on the queue when xdist reports the worker down.
            return

    def _top_up(self, node) -> None:
        if self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            self._assign_work_unit(node)
        # A worker starts a test only once it knows the next one (or that there is none): one
        # test left and no shutdown would wait forever (a replacement worker given a 1-test unit).
        while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()
