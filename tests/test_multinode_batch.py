"""The batch job across nodes survives losing one (issue 39): engine actors on two worker nodes of a
multi-node Ray on this machine (`ray.cluster_utils.Cluster`, as Ray's own tests build one), one node removed
mid-job; the job still finishes with exactly one row per id, each the same as an uninterrupted run's.

The cluster runs in a driver subprocess of its own (tests/helpers_multinode.py), which the test checks leaves
no process behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gpt2_platform import checkpoint
from gpt2_platform.batch.output import part_files
from gpt2_platform.model import GPT2, preset
from gpt2_platform.tokenizer import byte_tokenizer
from helpers_multinode import run_driver

pytestmark = pytest.mark.slow

MARKER_VAR = "GPT2_PLATFORM_TEST_MULTINODE_BATCH"
NUM_PROMPTS = 300

# The driver: a head without CPUs (so both actors land on workers), two workers of 2 CPUs, a run without
# faults, then the same run losing the node of one of its actors once a few batches are staged. The survivor
# must hold both actors (the restarted one joins it) and still have the CPU the job keeps for reading: Ray
# re-runs the read tasks whose blocks died with the node. Hence actors of half a CPU; with a whole one each,
# the restarted actor took the survivor's last CPU and the job waited for one forever. (Workers of 3 CPUs
# would do too, but Ray starts a worker process per CPU ahead of need, which costs this machine seconds.)
DRIVER = """
import json, sys, threading, time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray._private import state

from gpt2_platform.batch import load, run_generation
from gpt2_platform.batch.output import STAGING_NAME

overrides = json.loads(sys.argv[1])
out = Path(sys.argv[2])
cluster = Cluster(
    initialize_head=True,
    head_node_args={
        "num_cpus": 0,
        "include_dashboard": False,
        # Declare a lost node dead in about a second, not Ray's default of about fifteen.
        # Spread actors over the nodes by load from the first one (Ray's default packs a node to half full).
        "_system_config": {
            "health_check_period_ms": 200,
            "health_check_failure_threshold": 5,
            "scheduler_spread_threshold": 0.0,
        },
    },
)
workers = [cluster.add_node(num_cpus=2, resources={f"worker_{i}": 1}) for i in range(2)]
cluster.wait_for_nodes()
ray.init(address=cluster.address)
ray.data.DataContext.get_current().enable_progress_bars = False
result = {}
try:
    started = time.monotonic()
    run_generation(load(None, [*overrides, f"output.path={out / 'reference'}"]))
    result["reference_s"] = time.monotonic() - started

    output = out / "interrupted"
    removed = {}

    def engine_nodes() -> set:
        # The GCS's own table: the state API (list_actors) goes through the dashboard, which is off here.
        # The reference run's actors are DEAD by now.
        actors = state.actors().values()
        return {
            a["Address"]["NodeID"] for a in actors if "MapWorker" in a["ActorClassName"] and a["State"] == "ALIVE"
        }

    def remove_a_node() -> None:
        # A loaded machine may stage the first batches before the second actor is up: wait for both.
        deadline = time.monotonic() + 60
        while len(list((output / STAGING_NAME).glob("*/*.parquet"))) < 3 or (
            len(engine_nodes()) < 2 and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        nodes = engine_nodes()
        removed["engine_nodes"] = len(nodes)
        victim = next(w for w in workers if w.node_id in nodes)
        removed["staged"] = len(list((output / STAGING_NAME).glob("*/*.parquet")))
        removed["at"] = time.monotonic()
        cluster.remove_node(victim, allow_graceful=False)

    def remove_or_say_why() -> None:
        try:
            remove_a_node()
        except Exception as error:  # the assertions on `removed` then fail, with this in the log
            removed["error"] = repr(error)
            raise

    remover = threading.Thread(target=remove_or_say_why, daemon=True)
    started = time.monotonic()
    remover.start()
    summary = run_generation(load(None, [*overrides, f"output.path={output}"]))
    ended = time.monotonic()
    remover.join(timeout=1)
    engines = [a for a in state.actors().values() if "MapWorker" in a["ActorClassName"]]
    result.update(
        interrupted_s=ended - started,
        after_removal_s=ended - removed["at"] if "at" in removed else None,
        engine_nodes=removed.get("engine_nodes"),
        staged_at_removal=removed.get("staged"),
        remover_error=removed.get("error"),
        engine_actors=len(engines),
        engine_restarts=sum(a["NumRestarts"] for a in engines),
        alive_nodes=sum(node["Alive"] for node in ray.nodes()),
        summary=summary,
    )
finally:
    ray.shutdown()
    cluster.shutdown()
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("multinode") / "model"
    checkpoint.save_pretrained(GPT2(preset("tiny")), directory, extra=lambda d: byte_tokenizer().save_pretrained(d))
    return directory


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("multinode-input") / "prompts.parquet"
    text = [f"alice has {i} apples. bob gives her {i % 7}." for i in range(NUM_PROMPTS)]
    pq.write_table(pa.table({"prompt": pa.array(text, pa.string())}), path, row_group_size=100)
    return path


def read_rows(directory: Path) -> tuple[int, dict[str, dict]]:
    rows = pq.read_table([str(p) for p in part_files(directory)]).to_pylist()
    return len(rows), {row["id"]: row for row in rows}


def test_losing_a_node_mid_job_loses_and_duplicates_no_row(prompts: Path, model_dir: Path, tmp_path: Path):
    overrides = [
        f"input.paths=[{prompts}]",
        "output.progress_bars=false",
        f"model.path={model_dir}",
        "generation.max_tokens=4",
        "generation.temperature=0",
        "engine.max_batch_size=32",
        "engine.dtype=fp32",
        "scaling.num_actors=2",
        "scaling.num_cpus_per_actor=0.5",
        "scaling.batch_size=20",
        "scaling.concurrent_batches_per_actor=1",
    ]
    run = run_driver(DRIVER, [json.dumps(overrides), str(tmp_path)], MARKER_VAR, timeout_s=240)
    assert run.returncode == 0, run.log[-6000:]
    assert not run.survivors, f"Ray processes survived the test: {run.survivors}"
    result = run.result()
    print(json.dumps({k: v for k, v in result.items() if k != "summary"}))

    assert result["engine_nodes"] == 2, "the two engine actors should run on the two worker nodes"
    assert result["alive_nodes"] == 2, "the removed node should be gone (head and one worker left)"
    num_reference, reference = read_rows(tmp_path / "reference")
    num_rows, rows = read_rows(tmp_path / "interrupted")
    assert num_reference == len(reference) == NUM_PROMPTS
    assert num_rows == len(rows) == NUM_PROMPTS, "exactly one row per id"
    assert set(rows) == set(reference)
    for row_id, row in rows.items():
        assert row["error"] is None, row
        assert row["completion"] == reference[row_id]["completion"], row_id
    assert result["engine_restarts"] >= 1, "the removed node's engine actor should have been restarted"
    summary = result["summary"]
    assert summary["rows"] == summary["unique_ids"] == summary["rows_this_run"] == NUM_PROMPTS
