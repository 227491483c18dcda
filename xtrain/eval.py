"""`python -m xtrain.eval`: the command lives in xtrain/commands/evaluate.py."""

from xtrain.commands.evaluate import main

if __name__ == "__main__":
    main()
