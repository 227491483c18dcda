"""cluster=slurm: `submit` (checks, job parameters, the sbatch script), `node` (what runs on each node),
`monitor` (job states, following, settling, cancelling). The backend that uses them: backends/slurm.py."""
