"""The headroom's policy at vLLM's edge: how many destination blocks the adapter reserves, when
they yield to growth, and admission back-pressure while the reservation is short.

The reserved blocks themselves are the lifecycle's (``Lifecycle.headroom``: block ids, taken
from vLLM's pool with ``get_new_blocks``, ref_cnt 1, in no request's list, never hashed); plans
take destinations there and put unwritten ones back (``vtoken.lifecycle``). This room decides
only sizes and timing: top up, yield, give back, withhold fresh admissions. A soft reservation
(the vLLM adapter's default) holds nothing between steps: the plan book draws a plan's
destinations into the headroom as it launches (``draw``), within what ``drawable`` says, and
unwritten ones go back at the plan's end.
Owns: the requests withheld from the current ``schedule()``, the ``starved`` flag and the
count of blocks drawn in the current step.
May call: the lifecycle (``refill``, ``give_back``), vLLM's pool (the free count) and the
scheduler's waiting queue, both read through the harness each time (vLLM's tests swap the
manager after construction).
Costs: O(1) per hook plus the blocks taken or given; O(waiting) only while short.
"""

from __future__ import annotations


class Headroom:
    """The reservation policy of one adapter: ``harness`` (whose ``scheduler`` and ``pool`` are
    the adapter's), ``lifecycle`` (the reserved blocks), ``size`` (``PlannerConfig.headroom``; 0:
    nothing taken or withheld), at most 1/``pool_fraction`` of the live pool; ``soft``
    (``AdapterConfig.keep_headroom``, only with ``size`` 0): up to that many destinations a
    step, drawn from vLLM's free blocks when a plan launches (:meth:`draw`) while ``needed()``
    (a callable) says a plan may take one, never held between steps, never withholding; ``block_size`` (a
    waiting prompt's blocks are kept for it); ``stats``, this room's own counters
    (``VTokenAdapter.stats`` reads them); ``groups``: vLLM's
    KV cache groups (each grows its own list from the one pool: a step may take a block per group);
    ``frees_waiting``: a callable, do fenced frees wait for a step."""

    def __init__(self, harness, lifecycle, size: int, pool_fraction: int, block_size: int, stats: dict, *,
                 groups: int, frees_waiting, soft: int = 0, needed=None):
        assert int(pool_fraction) >= 1, "the adapter refuses headroom_pool_fraction < 1 before building"
        self.harness, self.lifecycle = harness, lifecycle
        self.size = int(size)
        self.pool_fraction = int(pool_fraction)
        self.S = int(block_size)
        self.stats = stats
        self.groups = int(groups)
        self.frees_waiting = frees_waiting  # do fenced frees wait for a step? (vLLM's or the adapter's port's)
        # the soft reservation (``size`` 0): up to ``soft`` blocks a step, drawn at launch while
        # ``needed()`` says a plan may take one, from what growth and the next admission leave
        self.soft = int(soft) if not self.size else 0
        self.needed = needed
        self.drawn = 0  # the soft reservation's blocks drawn in this step (drawable)
        self.withheld: list = []  # fresh requests sitting out the current schedule()
        self.starved = False  # given back because nothing could be admitted beside it

    def __len__(self) -> int:
        return len(self.lifecycle.headroom)

    def __bool__(self) -> bool:
        return bool(self.lifecycle.headroom)

    def target(self) -> int:
        """The reservation's size now: ``size``, or ``soft`` while ``needed()`` (else 0), capped at
        1/``pool_fraction`` of the live pool (so a tight pool is never starved by a full
        headroom). O(1)."""
        size = self.size or (self.soft if self.soft and self.needed() else 0)
        return min(size, (self.harness.pool.num_gpu_blocks - 1) // self.pool_fraction)

    def short(self) -> bool:
        """Below its target: admissions are held back (``withhold``); never for a soft reservation."""
        return bool(self.size) and len(self.lifecycle.headroom) < self.target()

    def give_back(self) -> int:
        """Every block back to vLLM's free queue now; returns how many."""
        return len(self.lifecycle.give_back())

    def kept_for_vllm(self) -> int:
        """The free blocks a reservation leaves vLLM: one per group per running request (its next
        block) and, when idle or for a soft reservation always, the waiting queue's next prompt
        in every group. O(1)."""
        sched = self.harness.scheduler
        reserve = len(sched.running) * self.groups
        if (not sched.running or self.soft) and len(sched.waiting):
            head = sched.waiting.peek_request()
            reserve += -(-(head.num_tokens - head.num_computed_tokens) // self.S) * self.groups
        return reserve

    def before_schedule(self) -> None:
        """Top a reservation (``size``) up, yielding to growth first (:meth:`kept_for_vllm`: vLLM
        never preempts or stalls for a block the headroom holds), then withhold fresh admissions
        while short. A soft one holds nothing across ``schedule()``: a block left from a plan's
        end goes back, and this step's draws (:meth:`drawable`) start again. O(1)."""
        lc = self.lifecycle
        if self.soft:
            self.drawn = 0
            if lc.headroom:
                lc.give_back()
        elif self.size:
            pool = self.harness.pool
            free, reserve = pool.get_num_free_blocks(), self.kept_for_vllm()
            if free < reserve and lc.headroom:
                lc.give_back(reserve - free)
                self.stats["headroom_yielded"] += 1
            elif not self.starved and self.harness.scheduler.get_num_unfinished_requests():  # none while idle
                take = min(self.target() - len(lc.headroom), free - reserve)
                if take > 0:
                    lc.refill(len(lc.headroom) + take)
        self.withhold()

    def drawable(self) -> int:
        """A soft reservation's destinations a plan may still draw from vLLM's free blocks at
        launch, in this step (:meth:`draw`): its target less what the step drew, within what
        :meth:`kept_for_vllm` leaves; 0 without one. Nothing is held for it between steps, so
        no idle block is taken from vLLM and none is counted kept. O(1)."""
        if not self.soft:
            return 0
        spare = self.harness.pool.get_num_free_blocks() - self.kept_for_vllm()
        return max(0, min(self.target() - self.drawn - len(self.lifecycle.headroom), spare))

    def draw(self, k: int) -> list:
        """``k`` (at most :meth:`drawable`) blocks from vLLM's free queue into the headroom's
        end, for the plan being launched; returns them in order."""
        assert 0 < k <= self.drawable(), f"draw {k}: at most {self.drawable()} drawable"
        lc = self.lifecycle
        n = len(lc.headroom)
        lc.refill(n + k)
        assert len(lc.headroom) == n + k, f"draw {k}: the pool gave {len(lc.headroom) - n}"
        self.drawn += k
        return lc.headroom[n:]

    def withhold(self) -> None:
        """Admission back-pressure, inside one ``schedule()``: while short, the waiting
        requests that never ran (they hold no block) leave vLLM's waiting queue for this
        call, unless nothing else could run (progress first). O(waiting), only while short."""
        sched = self.harness.scheduler
        if not self.short() or not len(sched.waiting):
            return
        from vllm.v1.request import RequestStatus

        fresh = [q for q in sched.waiting if q.status == RequestStatus.WAITING]  # preempted: PREEMPTED
        if not fresh or (not sched.running and len(fresh) == len(sched.waiting)):
            return  # nothing held back, or holding back would leave nothing to run
        sched.waiting.remove_requests(fresh)
        self.withheld = fresh
        self.stats["backpressure_steps"] += 1
        self.stats["held_back_max"] = max(self.stats["held_back_max"], len(fresh))

    def restore_withheld(self) -> None:
        """The withheld requests back at the tail of vLLM's waiting queue, in their order
        (they were its tail: fresh requests queue behind preempted ones). Runs even when
        ``schedule()`` raised (the hook's ``finally``)."""
        if self.withheld:
            for q in self.withheld:
                self.harness.scheduler.waiting.add_request(q)
            self.withheld = []

    def after_empty_step(self) -> None:
        """Nothing was scheduled: if nothing runs and a request waits, give the reservation back
        until a step runs again (it must not block progress)."""
        sched = self.harness.scheduler
        if self.lifecycle.headroom and not sched.running and len(sched.waiting) and not self.frees_waiting():
            self.give_back()
            self.starved = True
            self.stats["headroom_yielded"] += 1

    def after_update(self, plans_in_flight: bool) -> None:
        """Nothing runs: nothing is reserved (vLLM's leak checks and free counts see the whole
        pool); retaken at the next ``schedule()`` with work. A soft reservation's blocks back
        from a plan's end (unwritten destinations) go back at once."""
        sched = self.harness.scheduler
        if self.soft and self.lifecycle.headroom:
            self.give_back()
        elif self.lifecycle.headroom and not plans_in_flight and not sched.running and not self.frees_waiting():
            self.give_back()
            self.stats["headroom_idle_returns"] += 1
