"""The progress bar of rank 0: tqdm when installed, plain lines otherwise."""

from __future__ import annotations

import sys


class Progress:
    """A tqdm bar with loss, tokens/s and ETA when tqdm is installed; plain lines otherwise."""

    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, every: int = 5):
        self.enabled = enabled
        self.every = every
        self.total = total
        self._bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=sys.stdout, mininterval=0.5)
        except ImportError:
            self._bar = None

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
            self._bar.update(1)
        elif step % self.every == 0 or step == self.total - 1:
            print(f"step {step:5d}/{self.total}  loss {loss:.4f}  {tokens_per_s:.0f} tokens/s", flush=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
