"""One resolution of the layout per process: a rank makes one Topology, and the plan it loads and
hands to capture carries that very object."""

from specforge_core.config import config_from_dict
from specforge_core.launch.builder import check_plan_against_config
from specforge_core.run.plan import PromptPlan
from specforge_core.run.topology import Topology

RECORDED = {"deployment": {"nproc_per_node": 4}, "capture": {"tp_size": 2}, "training": {"batch_size": 2}}


def count_topologies(monkeypatch) -> list:
    made = []
    check = Topology.__post_init__
    monkeypatch.setattr(Topology, "__post_init__", lambda self: (made.append(self), check(self))[1])
    return made


def test_a_rank_makes_one_topology_and_hands_the_plans_copy_of_it_down(tmp_path, monkeypatch):
    flow_cfg = config_from_dict(RECORDED)
    PromptPlan.from_config(flow_cfg, 40, topology=flow_cfg.topology).save(tmp_path / "plan.json")

    made = count_topologies(monkeypatch)
    cfg = config_from_dict(RECORDED)  # what the rank reads from run.json
    topology = Topology.launched(cfg, 4)  # torchrun's world checked, nothing re-derived
    plan = PromptPlan.load(tmp_path / "plan.json", topology=topology)
    check_plan_against_config(cfg, plan, topology, 40, "plan.json")
    assert next(plan.island_batches(3)).local == slice(2, 4)  # the rollout reads its place from it too
    assert plan.topology is topology is cfg.topology
    assert made == [cfg.topology]


def test_the_flows_plan_carries_the_topology_its_config_made(monkeypatch):
    cfg = config_from_dict(RECORDED)
    made = count_topologies(monkeypatch)
    plan = PromptPlan.from_config(cfg, 40, topology=cfg.topology)
    assert plan.topology is cfg.topology and made == []
