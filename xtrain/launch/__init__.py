"""From a config to ranks running on one machine or node: preflight.py (every check before anything
starts; the run dir and its accelerate files written), hardware.py (what this machine cannot run, refused),
plan.py (the dry run's plan), supervisor.py (torchrun's process tree: started, watched, stopped), agent.py (torchrun
whose ranks are forks of one process that has imported torch, transformers and Accelerate) and worker.py (each rank's
entry point, which calls engine.loop.train).

May import: core, config, data, parallel, tasks, engine.
"""
