"""`python -m xtrain.export`: the command lives in xtrain/commands/export.py."""

from xtrain.commands.export import main

if __name__ == "__main__":
    main()
