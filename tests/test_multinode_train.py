"""Training across nodes (issue 39): two DDP workers over gloo on two worker nodes of a multi-node Ray on this
machine (`ray.cluster_utils.Cluster`), storage in a directory every node sees (as NFS would be).

- A node with a worker is removed after a checkpoint (step 4 or later) and another joins a moment later: the run
  resumes from that checkpoint by itself, and its per-step losses are the uninterrupted run's.
- A node is removed and none comes back: the run fails after scaling.resource_timeout_s with one line.
- A storage path that a node does not see is refused before anything starts. Every node of this machine sees
  every path, so the test makes one node look for another file than the marker the driver wrote.

One driver runs the four runs on one cluster (a Ray start costs seconds on 2 cores), in a subprocess of its own
(tests/helpers_multinode.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpt2_platform import demo_data
from gpt2_platform.train.resume import OPTIMIZER_STATE
from gpt2_platform.train.shared_paths import MARKER_PREFIX
from helpers_multinode import run_driver

pytestmark = [pytest.mark.slow, pytest.mark.multinode]

MARKER_VAR = "GPT2_PLATFORM_TEST_MULTINODE_TRAIN"
MAX_STEPS = 12
CHECKPOINT_EVERY = 4
RESOURCE_TIMEOUT_S = 3

# The driver. A head without CPUs runs the driver and Ray Train's controller; each worker node has one
# `train_slot`, which each training worker asks for, so the two workers land on two nodes (Ray Train packs its
# workers onto as few nodes as hold them), and a node that joins later has one too.
DRIVER = """
import json, os, signal, sys, threading, time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray._private import state

from gpt2_platform.train import config as config_lib, shared_paths
from gpt2_platform.train.loop import HISTORY
from gpt2_platform.train.trainer import fit

# Every report waits for the controller's next poll of the workers (tests/conftest.py): poll more often than the
# session's 0.2 s, for runs that report every step.
os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.05"
overrides, out, resource_timeout_s = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
WORKER_NODE = {"num_cpus": 2, "resources": {"train_slot": 1}}
cluster = Cluster(
    initialize_head=True,
    head_node_args={
        "num_cpus": 0,
        "include_dashboard": False,
        # Declare a lost node dead in about a second, not Ray's default of about fifteen.
        "_system_config": {"health_check_period_ms": 200, "health_check_failure_threshold": 5},
    },
)
workers = [cluster.add_node(wait=False, **WORKER_NODE) for _ in range(2)]
cluster.wait_for_nodes()
ray.init(address=cluster.address)
ray.data.DataContext.get_current().enable_progress_bars = False


def config(name, *extra):
    return config_lib.load(None, [*overrides, f"run.storage_path={out / 'runs'}", f"run.name={name}", *extra])


def history(name):
    path = out / "runs" / name / HISTORY
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]  # not a line being written


def steps_before_restart(name, thread):
    # The restarted workers drop the steps past their checkpoint from the history: read it until then.
    last = 0
    while thread.is_alive():
        records = history(name)
        if sum(r.get("event") == "start" for r in records) > 1:
            break
        last = max([last] + [r.get("step", 0) for r in records])
        time.sleep(0.02)
    return last


def fit_in_thread(name, *extra):
    # The main thread stays free to add nodes: Cluster.add_node sets a signal handler, which only it may.
    outcome = {}

    def run():
        try:
            outcome["result"] = fit(config(name, *extra))
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def wait_for(name, thread, step):
    deadline = time.monotonic() + 120
    while thread.is_alive() and time.monotonic() < deadline and not any(r.get("step", 0) >= step for r in history(name)):
        time.sleep(0.02)


def remove_a_training_node(name, thread):
    wait_for(name, thread, 1)
    nodes = {
        a["Address"]["NodeID"]
        for a in state.actors().values()
        if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE"
    }
    victim = next(w for w in workers if w.node_id in nodes)
    # Once step 5 is logged, the step-4 checkpoint is whole: rank 0 logs a step after the last one's report,
    # which returns once its checkpoint is stored.
    wait_for(name, thread, 5)
    removed = {"training_nodes": len(nodes), "at": time.time()}
    lose(victim)
    return removed


def lose(node):
    # A machine that goes takes all its processes at once; remove_node alone kills the raylet and leaves its
    # workers (its child processes) to notice, a moment in which a training worker goes on a few steps.
    raylet = node.all_processes["raylet"][0].process.pid
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == raylet:
            os.kill(int(proc.name), signal.SIGKILL)
    cluster.remove_node(node, allow_graceful=False)
    workers.remove(node)


result = {}
try:
    # A node that does not see the storage: it looks for another name than the marker's.
    sees = shared_paths.missing_paths
    blind_node = workers[1].node_id

    def blind_to_the_marker(paths):
        if ray.get_runtime_context().get_node_id() != blind_node:
            return sees(paths)
        return [p for p in paths if shared_paths.MARKER_PREFIX in p] + sees(
            [p for p in paths if shared_paths.MARKER_PREFIX not in p]
        )

    shared_paths.missing_paths = blind_to_the_marker
    started = time.monotonic()
    try:
        fit(config("refused"))
    except Exception as error:
        result["refused"] = {"type": type(error).__name__, "message": str(error), "node": blind_node[:8]}
    result["refused_s"] = time.monotonic() - started
    shared_paths.missing_paths = sees

    started = time.monotonic()
    fit(config("reference"))
    result["reference_s"] = time.monotonic() - started

    started = time.monotonic()
    thread, outcome = fit_in_thread("interrupted")
    removed = remove_a_training_node("interrupted", thread)
    time.sleep(0.5)
    workers.append(cluster.add_node(**WORKER_NODE))
    removed["node_added_at"] = time.time()
    # A worker of the lost node may log a step or two more before it notices.
    removed["last_step"] = steps_before_restart("interrupted", thread)
    thread.join()
    result["interrupted"] = {
        "removed": removed,
        "error": repr(outcome.get("error")) if "error" in outcome else None,
        "checkpoint": str(outcome["result"].checkpoint_dir) if "result" in outcome else None,
        "seconds": time.monotonic() - started,
    }

    thread, outcome = fit_in_thread("stranded", f"scaling.resource_timeout_s={resource_timeout_s}")
    removed = remove_a_training_node("stranded", thread)
    thread.join()
    error = outcome.get("error")
    result["stranded"] = {
        "removed": removed,
        "error_type": type(error).__name__,
        "error": str(error),
        "failed_after_removal_s": time.time() - removed["at"],
    }
finally:
    ray.shutdown()
    cluster.shutdown()
print("RESULT " + json.dumps(result))
"""


def losses(run_dir: Path) -> tuple[list[dict], dict[int, float]]:
    records = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "start"], {r["step"]: r["loss"] for r in records if "loss" in r}


def test_training_across_nodes_survives_a_lost_node_and_refuses_unshared_storage(tmp_path: Path):
    corpus = demo_data.write_text(tmp_path / "corpus.txt", num_stories=500)
    overrides = [
        f"data.paths=[{corpus}]",
        "data.block_size=32",
        "data.val_fraction=0",
        "train.micro_batch_size=8",
        f"train.max_steps={MAX_STEPS}",
        "train.log_every=1",
        "train.eval_every=0",
        f"train.checkpoint_every={CHECKPOINT_EVERY}",
        "train.keep_checkpoints=4",
        "train.max_failures=2",
        "train.precision=fp32",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "scaling.num_workers=2",
        "scaling.resources_per_worker={train_slot: 1}",
    ]
    run = run_driver(DRIVER, [json.dumps(overrides), str(tmp_path), str(RESOURCE_TIMEOUT_S)], MARKER_VAR, timeout_s=300)
    assert run.returncode == 0, run.log[-8000:]
    assert not run.survivors, f"Ray processes survived the test: {run.survivors}"
    result = run.result()
    runs = tmp_path / "runs"

    # Refused up front, naming the setting and the node, before any run directory or checkpoint existed.
    refused = result["refused"]
    assert refused["type"] == "SharedPathError", refused
    assert "run.storage_path=" in refused["message"] and "not one filesystem on every node" in refused["message"]
    assert f"(node {refused['node']})" in refused["message"]
    assert not (runs / "refused").exists()
    assert not [p for p in tmp_path.rglob(f"{MARKER_PREFIX}*")], "the marker file is removed"

    # Resumed by itself from the checkpoint before the loss, with the uninterrupted run's losses.
    interrupted = result["interrupted"]
    removed = interrupted["removed"]
    assert interrupted["error"] is None, interrupted
    assert removed["training_nodes"] == 2, "the two workers should run on two nodes"
    _, reference = losses(runs / "reference")
    starts, resumed = losses(runs / "interrupted")
    # Rank 0 logs a step after the report of the step before has stored its checkpoint, so the newest checkpoint
    # whole when the workers stopped is the last multiple of CHECKPOINT_EVERY below the last step logged, or
    # that step itself if its checkpoint was stored before the workers noticed the loss.
    assert len(starts) == 2 and starts[0]["start_step"] == 0, (starts, removed)
    resumed_from, last_step = starts[1]["start_step"], removed["last_step"]
    whole = last_step - 1 - (last_step - 1) % CHECKPOINT_EVERY
    assert resumed_from % CHECKPOINT_EVERY == 0 and whole <= resumed_from <= last_step, (starts, removed)
    assert [s["world_size"] for s in starts] == [2, 2]
    assert sorted(resumed) == sorted(reference) == list(range(1, MAX_STEPS + 1))
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), step
    state = torch.load(Path(interrupted["checkpoint"]) / OPTIMIZER_STATE, weights_only=True)["state"]
    assert int(next(iter(state.values()))["step"]) == MAX_STEPS, "no optimizer step repeated or skipped"

    # No room came back: one line naming scaling.resource_timeout_s and the checkpoint to resume from.
    stranded = result["stranded"]
    assert stranded["error_type"] == "ClusterResourcesError", stranded
    message = stranded["error"]
    assert "\n" not in message
    assert f"scaling.resource_timeout_s={RESOURCE_TIMEOUT_S} s" in message
    newest = max(p.name for p in (runs / "stranded").glob("checkpoint_step_*"))
    assert f"{newest}: resubmit the same run.name" in message
    assert RESOURCE_TIMEOUT_S <= stranded["failed_after_removal_s"] < RESOURCE_TIMEOUT_S + 60

    figures = {
        "refused_s": round(result["refused_s"], 1),
        "reference_s": round(result["reference_s"], 1),
        "interrupted_s": round(interrupted["seconds"], 1),
        # From the node's removal to the restarted workers' first record (a node was added 0.5 s after it).
        "resumed_after_s": round(starts[1]["time"] - removed["at"], 1),
        # Steps trained past the checkpoint when the node went, and trained again.
        "steps_redone": last_step - resumed_from,
        "stranded_failed_after_s": round(stranded["failed_after_removal_s"], 1),
    }
    print(json.dumps(figures))
