"""Times every `mx.async_eval` call of a process, by call site (bench only).

Put this folder on PYTHONPATH with PIPPIN_PROBE_EVAL=DIR set: every Python process then
(an engine process too) writes DIR/async-eval-PID.txt at exit: per call site, calls and
the p50/p90/mean milliseconds. PIPPIN_PROBE_SYNC=1 waits for the device before each call
(timed apart, as `sync`), so the call's own time is host work only; =2 also waits after
it (`device after`: the device's time for what the call launched) and lists every call.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

_DIR = os.environ.get("PIPPIN_PROBE_EVAL")


def _install() -> None:
    import mlx.core as mx

    sync_mode = os.environ.get("PIPPIN_PROBE_SYNC", "0")
    original, sync, after = mx.async_eval, sync_mode in ("1", "2"), sync_mode == "2"
    log: list[str] = []  # with after: each call's site, host ms, device ms after it
    times: dict[str, list[float]] = {}
    calls = [0]
    start = time.perf_counter()
    # Per second since the first call: calls, total and longest time in async_eval.
    seconds: dict[int, list[float]] = {}

    def async_eval(*args: object) -> None:
        f = sys._getframe(1)
        site = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
        if sync:
            t0 = time.perf_counter()
            mx.synchronize()
            times.setdefault("sync before " + site, []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        original(*args)
        t1 = time.perf_counter()
        if after:
            mx.synchronize()
            t2 = time.perf_counter()
            times.setdefault("device after " + site, []).append(t2 - t1)
            log.append(f"{site} {(t1 - t0) * 1e3:.2f} {(t2 - t1) * 1e3:.2f}")
        times.setdefault(site, []).append(t1 - t0)
        sec = seconds.setdefault(int(t1 - start), [0, 0.0, 0.0])
        sec[0] += 1
        sec[1] += t1 - t0
        sec[2] = max(sec[2], t1 - t0)
        calls[0] += 1
        if calls[0] % 200 == 0:  # a process may be killed rather than exit
            report()

    def report() -> None:
        if not times:
            return
        lines = []
        for site, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
            ts = sorted(ts)
            n = len(ts)
            lines.append(
                f"{site:40s} {n:7d} calls  p50 {ts[n // 2] * 1e3:7.2f} ms  "
                f"p90 {ts[n * 9 // 10] * 1e3:7.2f} ms  mean {sum(ts) / n * 1e3:7.2f} ms"
            )
        lines.append("second  calls  ms in async_eval  longest ms")
        for sec, (n, total, longest) in sorted(seconds.items()):
            lines.append(f"{sec:6d} {n:6d} {total * 1e3:9.1f} {longest * 1e3:9.1f}")
        if log:
            lines += ["call site, ms in the call, ms the device ran after it", *log]
        with open(os.path.join(_DIR or ".", f"async-eval-{os.getpid()}.txt"), "w") as out:
            out.write(" ".join(sys.argv[:2]) + "\n" + "\n".join(lines) + "\n")

    mx.async_eval = async_eval
    atexit.register(report)


if _DIR:
    import importlib.abc
    import importlib.machinery

    class _Hook(importlib.abc.MetaPathFinder):
        """Wraps async_eval once mlx.core is first imported (not before: importing MLX
        here would come before pippin's MLX settings)."""

        def find_spec(self, name: str, path: object, target: object = None) -> None:
            if name == "mlx.core":
                sys.meta_path.remove(self)
                spec = importlib.machinery.PathFinder.find_spec(name, path)  # type: ignore[arg-type]
                if spec is not None and spec.loader is not None:
                    exec_module = spec.loader.exec_module

                    def run(module: object) -> None:
                        exec_module(module)  # type: ignore[arg-type]
                        sys.modules["mlx.core"] = module  # type: ignore[assignment]
                        _install()

                    spec.loader.exec_module = run  # type: ignore[method-assign]
                return spec  # type: ignore[return-value]
            return None

    sys.meta_path.insert(0, _Hook())
