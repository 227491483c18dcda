"""`python -m xtrain.env`: the command lives in xtrain/commands/env.py."""

from xtrain.commands.env import main

if __name__ == "__main__":
    main()
