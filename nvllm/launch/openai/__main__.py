"""``python -m nvllm.launch.openai``: the same as ``nvllm-serve``."""

from nvllm.launch.openai.cli import main

if __name__ == "__main__":
    main()
