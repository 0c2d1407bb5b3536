"""Where vtoken sits in vLLM's scheduler: ``scheduler_class(base)`` returns ``VToken<Base>``,
whose ``schedule()`` calls the adapter before and after vLLM's own code,
``update_from_output()`` before and after it, ``_free_request_blocks()`` and
``reset_prefix_cache()`` before it; ``has_requests()`` also says yes while plans are in flight
(they end only on later steps, which vLLM's engine takes only while it has requests). The hooks
only call out; everything else is vLLM's.
Owns: nothing (the subclass holds only the attached adapter).
May call: the adapter's hook methods and vLLM's base class.
Costs: three attribute lookups per call when no adapter is attached.
"""

from __future__ import annotations


def scheduler_class(base: type) -> type:
    """A subclass of vLLM's ``base`` scheduler class with the adapter's three hooks."""

    class VTokenScheduler(base):  # type: ignore[misc, valid-type]
        vtoken_adapter = None

        def schedule(self, *args, **kwargs):
            ad = self.vtoken_adapter
            if ad is None:
                return super().schedule(*args, **kwargs)
            try:
                ad._before_schedule()
                sched_out = super().schedule(*args, **kwargs)
            finally:
                ad._restore_withheld()  # back-pressured requests back in vLLM's queue, whatever happened
            ad._after_schedule(sched_out)
            return sched_out

        def update_from_output(self, scheduler_output, model_runner_output):
            ad = self.vtoken_adapter
            if ad is not None:
                ad._before_update(scheduler_output, model_runner_output)
            result = super().update_from_output(scheduler_output, model_runner_output)
            if ad is not None:
                ad._after_update(scheduler_output, model_runner_output)
            return result

        def has_requests(self, *args, **kwargs):
            ad = self.vtoken_adapter
            # plans in flight need steps to end (vLLM's engine stops stepping when it has no requests)
            return super().has_requests(*args, **kwargs) or (ad is not None and ad._needs_steps())

        def reset_prefix_cache(self, reset_running_requests: bool = False, *args, **kwargs):
            ad = self.vtoken_adapter
            if ad is None:
                return super().reset_prefix_cache(reset_running_requests, *args, **kwargs)
            ad._before_reset_prefix_cache()
            return super().reset_prefix_cache(reset_running_requests, *args, **kwargs)

        def _free_request_blocks(self, request):
            ad = self.vtoken_adapter
            if ad is not None:
                ad._on_request_free(request)
            return super()._free_request_blocks(request)

    VTokenScheduler.__name__ = VTokenScheduler.__qualname__ = f"VToken{base.__name__}"
    return VTokenScheduler
