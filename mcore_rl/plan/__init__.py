"""Planning at scale: a discrete-event simulator of the RL graph (`simulate`), on a virtual
clock and per-phase costs (`CostModel`), and the split of a device
budget between engine replicas and the trainer (`plan_for_devices`). Pure Python: the
figures are the model's output, as good as its costs.

    costs = CostModel.from_dict(json.load(open("costs.json")))
    result = simulate(costs, "async", k=2, replicas=4, steps=40)
    rows = plan_for_devices(costs, devices=16, engine_share=0.75, ks=(0, 1, 2))
"""
from mcore_rl.plan.costs import CostModel, LengthDistribution
from mcore_rl.plan.result import SimResult
from mcore_rl.plan.simulator import SCHEDULES, Delays, simulate

__all__ = ["CostModel", "Delays", "LengthDistribution", "SCHEDULES", "SimResult", "simulate"]
