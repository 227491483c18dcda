#!/usr/bin/env bash
# The packages a lent GPU machine's image lacks (it has torch, transformers, accelerate, peft, pyarrow), as
# Python 3.12 wheels in .whl/ (git-ignored), for a device call to carry and install:
#   bash benchmarks/device_wheels.sh
#   (there) python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#           export PYTHONPATH=/tmp/site:$PWD:$PWD/launchers
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 hjson==3.1.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 torchao==0.18.0
# published as source only: pure Python, so a wheel built here installs there
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 deepspeed==0.19.8
du -sh .whl
