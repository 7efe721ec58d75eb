"""deployments/: prefect.yaml and the serve alternative describe the same deployments: default and nightly
on the CPU pool, one per GPU recipe (examples/gpu/) on the GPU pool."""

from pathlib import Path

import yaml

from deployments.serve import deployments_from_yaml
from specforge_core.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
BY_NAME = {d["name"]: d for d in SPEC["deployments"]}
RECIPES = {p.stem: p for p in (REPO / "examples" / "gpu").glob("*.yaml")}


def test_there_are_default_nightly_and_one_deployment_per_gpu_recipe_of_colocated_train():
    assert RECIPES and set(BY_NAME) == {"default", "nightly", *RECIPES}
    assert {d["entrypoint"] for d in BY_NAME.values()} == {"flows/colocated_train.py:colocated_train"}


def test_default_and_nightly_run_on_the_cpu_pool_the_recipes_on_the_gpu_pool():
    assert {BY_NAME[n]["work_pool"]["name"] for n in ("default", "nightly")} == {"colocated-pool"}
    assert {BY_NAME[n]["work_pool"]["name"] for n in RECIPES} == {"gpu-pool"}


def test_each_gpu_deployment_runs_its_recipe():
    for name, recipe in RECIPES.items():
        assert RunConfig.model_validate(BY_NAME[name]["parameters"]["config"]) == load_config(recipe), name


def test_a_multi_node_recipe_names_a_launcher_and_no_deployment_sets_a_launch_command():
    for name, recipe in RECIPES.items():
        d = load_config(recipe).deployment
        assert (d.launcher == f"srun-{d.nnodes}node") if d.nnodes > 1 else d.launcher is None, name
    for name, spec in BY_NAME.items():
        env = spec["work_pool"]["job_variables"]["env"]
        assert not [k for k in env if k.startswith("SPECFORGE_LAUNCH")], name


def test_flow_runs_start_in_the_directory_prefect_deploy_ran_in():
    [step] = SPEC["pull"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $PWD }}"


def test_default_parameters_are_the_smollm2_cpu_example():
    example = load_config(REPO / "examples" / "smollm2-cpu.yaml")
    assert RunConfig.model_validate(BY_NAME["default"]["parameters"]["config"]) == example


def test_nightly_is_the_same_run_with_warm_start_and_gated_promotion():
    nightly = RunConfig.model_validate(BY_NAME["nightly"]["parameters"]["config"])
    assert nightly.draft.init_from == nightly.validation.promoted_dir is not None
    assert nightly.validation.promote_margin > 0
    example = load_config(REPO / "examples" / "smollm2-cpu.yaml")
    assert (nightly.model, nightly.data, nightly.training) == (example.model, example.data, example.training)


def test_nightly_is_a_daily_cron_with_concurrency_limit_one():
    nightly = BY_NAME["nightly"]
    assert [(s["cron"], s.get("active", True)) for s in nightly["schedules"]] == [("0 3 * * *", True)]
    assert nightly["concurrency_limit"] == 1


def test_serve_builds_the_same_deployments():
    served = {d.name: d for d in deployments_from_yaml()}
    assert set(served) == set(BY_NAME)
    assert served["nightly"].concurrency_limit == 1
    assert [s.schedule.cron for s in served["nightly"].schedules] == ["0 3 * * *"]
    assert served["default"].parameters == BY_NAME["default"]["parameters"]
