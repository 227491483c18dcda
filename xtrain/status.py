"""`python -m xtrain.status`: the command lives in xtrain/commands/status.py."""

from xtrain.commands.status import main

if __name__ == "__main__":
    main()
