"""`torch.sagemaker.distributed.checkpoint.async_utils.AsyncCallsQueue`: the queue of async
saves a script passes to `state_dict_saver.async_save(..., queue=q)` and finalizes with
`q.maybe_finalize_async_calls(blocking, process_group)`. Each call is a DCP async save."""

from __future__ import annotations

from concurrent.futures import Future

import torch.distributed as dist

from smp.sagemaker._guide import unsupported_module_getattr


class AsyncCallsQueue:
    """Async saves not yet finalized, oldest first, each with the index `async_save` returned."""

    def __init__(self, concurrent_calls: bool = False) -> None:
        self._pending: list[tuple[int, Future]] = []
        self._next_index = 0

    def add(self, future: Future) -> int:
        index, self._next_index = self._next_index, self._next_index + 1
        self._pending.append((index, future))
        return index

    def get_num_unfinalized_calls(self) -> int:
        return len(self._pending)

    def maybe_finalize_async_calls(self, blocking: bool = False,
                                   process_group: dist.ProcessGroup | None = None) -> list[int]:
        """Finish async saves: all of them (`blocking`), else those done on every rank of
        `process_group` (default: all ranks; call it on all of them). Returns their indices and
        re-raises a failed save's error."""
        count = len(self._pending)
        if not blocking:
            count = next((i for i, (_, f) in enumerate(self._pending) if not f.done()), count)
            if dist.is_initialized():  # finalize only what every rank finished: the same calls everywhere
                agreed = [None] * dist.get_world_size(process_group)
                dist.all_gather_object(agreed, count, group=process_group)
                count = min(agreed)
        finished, self._pending[:] = self._pending[:count], self._pending[count:]
        for _, future in finished:
            future.result()
        return [index for index, _ in finished]

    def close(self) -> None:
        self.maybe_finalize_async_calls(blocking=True)


__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.distributed.checkpoint.async_utils", "checkpoints",
    "AsyncCallsQueue is the one name smp implements here",
)
