"""The option groups Hydra composes (`pkg://xtrain.conf`): one folder per group, each option a YAML file over
config/'s schema of that group; config.yaml picks the defaults."""
