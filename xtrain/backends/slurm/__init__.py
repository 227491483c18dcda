"""cluster=slurm: backend.py (the backend's entry points), submit.py (checks, job parameters, the sbatch script),
node.py (what runs on each node) and monitor.py (job states, following, settling, cancelling)."""
