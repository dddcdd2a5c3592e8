"""The roles of the jobs' graphs (`mcore_rl.flow` controllers' functions) and the graphs
themselves: rollout (`generate.Generate`, `continuous.ContinuousGenerate`), reward
(`score.Score`, a reward model's worker group in `reward_model`), the trainers
(`train.Train` for RL, `finetune.FinetuneTrain`, `smoke.SmokeTrain`), how a config becomes
a graph placed on cores or GPUs (`graph`), and what can run (`rules`). Nothing is imported
here: a login node checks a config with `rules` without loading torch."""
