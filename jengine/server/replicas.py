"""Data-parallel replicas (`--dp-size M`): M engines on disjoint device groups behind one server.

`ReplicaSet` looks like one Engine to the server (AsyncEngine, the routes, the metrics), so none
of them knows how many replicas there are. Each replica is a whole Engine -- its own runner and
weights on devices [i*tp, (i+1)*tp) (sharding.mesh.replica_devices), its own KV pool, scheduler
and engine thread -- and replicas share nothing but the process.

    submit          to the least-loaded replica: fewest requests in flight on it (running and
                    waiting, counted here from submit to final output), ties to the lowest index;
                    the output's meta_info.replica says which replica served it
    abort_many      each rid to the replica serving it (a base rid of n > 1 samples: to all)
    flush_cache, the RL commands (weight updates, pause / continue, memory release / resume)
                    on every replica at once; one answer, refused if any replica refuses
    stats           summed over replicas, plus each replica's own under "replicas"
    server_info     replica 0's launch and model, plus dp_size and each replica's devices and load

Under rl-bitwise a request's bits depend on neither its batch nor its replica, so the same request
gives the same ids and logprob bits on every replica (tests/test_server_replicas.py) and an RL
framework may spread rollouts freely. Every replica applies the same weight commands in the same
order, so they serve the same weight version; get_weight_version checks it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

logger = logging.getLogger(__name__)

# stats() keys that add up over replicas (counts and token totals); the rest are replica 0's.
_SUMMED = ("num_running", "num_waiting", "kv_used_tokens", "kv_total_tokens",
           "cache_hit_tokens_total", "retractions_total", "prompt_tokens_total",
           "generation_tokens_total", "requests_total")


class ReplicaSet:
    def __init__(self, replicas: list[Any]):
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica")
        self.replicas = list(replicas)
        first = self.replicas[0]
        # What the server reads off "the engine": the same on every replica (one launch, one model).
        self.plan, self.config, self.resolved = first.plan, first.config, first.resolved
        self.tokenizer, self.model_config = first.tokenizer, first.model_config
        self.request_limits = first.request_limits
        self._lock = threading.Lock()
        self._where: dict[str, int] = {}  # rid in flight -> its replica
        self._load = [0] * len(self.replicas)  # requests in flight per replica
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas),
                                        thread_name_prefix="jengine-replicas")

    @classmethod
    def from_config(cls, cfg: Any) -> "ReplicaSet":
        """cfg.dp_size engines, replica i on devices [i*tp, (i+1)*tp); one after the other, so
        the first one's refusal (e.g. too few devices, naming both sizes) comes before any work."""
        from jengine.engine.engine import Engine

        replicas: list[Any] = []
        try:
            for i in range(cfg.dp_size):
                replicas.append(Engine.from_config(cfg, replica=i))
                logger.info("replica %d of %d ready", i + 1, cfg.dp_size)
        except BaseException:
            for eng in replicas:
                eng.shutdown()
            raise
        return cls(replicas)

    @property
    def dp_size(self) -> int:
        return len(self.replicas)

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, *, on_output: Callable[[dict], None] | None = None, **request: Any) -> Any:
        """Engine.submit on the least-loaded replica (same arguments, same handle)."""
        with self._lock:  # the count and the choice are one step, so a burst spreads evenly
            i = min(range(len(self.replicas)), key=lambda r: (self._load[r], r))
            handle = self.replicas[i].submit(on_output=self._relay(i, on_output), **request)
            for rid in handle.rids:
                self._where[rid] = i
            self._load[i] += len(handle.rids)
        return handle

    def _relay(self, replica: int, on_output: Callable | None) -> Callable[[dict], None]:
        def relay(out: dict) -> None:  # the replica's output-processor thread
            out.setdefault("meta_info", {})["replica"] = replica
            if out.get("finished"):
                # Under the lock: a final output that beats submit's bookkeeping waits for it.
                with self._lock:
                    if self._where.pop(out["meta_info"].get("id"), None) is not None:
                        self._load[replica] -= 1
            if on_output is not None:
                on_output(out)
        return relay

    def abort_many(self, rids, message: str = "aborted by the client") -> int:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for rid in rids:
                where = self._where.get(rid)
                for i in range(len(self.replicas)) if where is None else (where,):
                    by_replica.setdefault(i, []).append(rid)
        return sum(self.replicas[i].abort_many(r, message) for i, r in by_replica.items())

    # -- commands on every replica ----------------------------------------------------------------
    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every replica at once (each waits for its own step boundary) and
        return their results in replica order; the first replica's exception is raised."""
        futures = [self._pool.submit(getattr(r, method), *args, **kwargs) for r in self.replicas]
        return [f.result() for f in futures]

    def _answer_once(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Replica 0's answer: every replica ran the same command on the same state. A refusal
        (a bad path, tag or mode) is the same on each, so all refuse and the old state serves."""
        return self._on_all(method, *args, **kwargs)[0]

    def flush_cache(self) -> bool:
        return all(self._on_all("flush_cache"))

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> dict:
        return self._answer_once("update_weights_from_disk", *args, **kwargs)

    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> dict:
        return self._answer_once("update_weights_from_tensor", *args, **kwargs)

    def update_weights_from_safetensors(self, *args: Any, **kwargs: Any) -> dict:
        return self._answer_once("update_weights_from_safetensors", *args, **kwargs)

    def pause_generation(self, *args: Any, **kwargs: Any) -> dict:
        return self._answer_once("pause_generation", *args, **kwargs)

    def continue_generation(self) -> dict:
        return self._answer_once("continue_generation")

    def release_memory_occupation(self, *args: Any, **kwargs: Any) -> dict:
        return self._answer_once("release_memory_occupation", *args, **kwargs)

    def resume_memory_occupation(self, *args: Any, **kwargs: Any) -> dict:
        return self._answer_once("resume_memory_occupation", *args, **kwargs)

    def get_weight_version(self) -> str:
        versions = [r.get_weight_version() for r in self.replicas]
        if len(set(versions)) != 1:  # a bug, never a state a client should be served from
            raise RuntimeError(f"replicas serve different weight versions: {versions}")
        return versions[0]

    # -- one view -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        per = [r.stats() for r in self.replicas]
        merged = {k: v for k, v in per[0].items() if k != "step_latency_seconds"}
        merged.update({k: sum(s.get(k, 0) for s in per) for k in _SUMMED})
        merged["replicas"] = per
        return merged

    def server_info(self) -> dict[str, Any]:
        info = self.replicas[0].server_info()
        with self._lock:
            load = list(self._load)
        info["dp_size"] = len(self.replicas)
        info["replicas"] = [{"replica": i, "devices": _devices(r), "requests_in_flight": load[i],
                             "weight_version": r.get_weight_version()}
                            for i, r in enumerate(self.replicas)]
        return info

    def shutdown(self) -> None:
        try:
            self._on_all("shutdown")
        finally:
            self._pool.shutdown(wait=False)


def _devices(engine: Any) -> list[str]:
    """The devices a replica's KV pool lives on: its device group."""
    sharding = getattr(engine.runner.kv_pool, "sharding", None)
    return [] if sharding is None else [str(d) for d in sorted(sharding.device_set,
                                                                key=lambda d: d.id)]


def serving_engine(cfg: Any) -> Any:
    """What `jengine serve` serves: one Engine, or with --dp-size M > 1 a ReplicaSet of M."""
    from jengine.engine.engine import Engine

    return Engine.from_config(cfg) if cfg.dp_size == 1 else ReplicaSet.from_config(cfg)
