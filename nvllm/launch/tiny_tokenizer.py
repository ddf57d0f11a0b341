"""The tiny checkpoints' tokenizer: a byte-level BPE trained on a fixed English text, with
ChatML special tokens and template (see ``build_tokenizer``), optionally with Qwen's
tool-calling tokens and template. Deterministic across processes, so a checkpoint's files
are byte-identical wherever they are built."""

from __future__ import annotations

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trained first, so they get ids 0, 1, 2 in this order.
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# The tokenizer never has more entries than this, so even with the default vocab_size=1024
# a few model ids (>= len(tokenizer)) have no token; see build_tokenizer for how they decode.
_MAX_TOKENIZER_VOCAB = 1000

# Qwen2.5/Qwen3's tool-calling markers: added tokens that are NOT special, as in Qwen's
# tokenizer (so skip_special_tokens keeps them in the text a tool parser reads). Added after
# training, so the other tokens' ids are those of the plain tokenizer.
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
TOOL_TOKENS = [TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2.5's tool-calling chat template, shortened (no default system prompt): the tools as
# JSON lines in a `# Tools` system block, assistant tool calls as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, tool results as
# <tool_response> blocks in a user turn.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Fixed, original training text for the BPE merges.  It only needs to be ordinary English so
# that common words become single tokens and prompts tokenize to realistic lengths.  Changing
# it changes every tiny checkpoint's tokenizer, so leave it alone.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still be a useful tool when
the goal is to test the plumbing of an inference engine rather than the quality of its text.
Every request arrives with a prompt, a sampling configuration and a limit on the number of new
tokens. The scheduler decides which requests run in the next step, the workers compute the
attention and the feed forward layers, and the sampler picks the next token for each sequence.
When a sequence produces the end of text token or reaches its limit, it is finished and its
memory is returned to the pool.

Once upon a time there was a little town by the sea. The people of the town were fishermen,
bakers, teachers and sailors. In the morning the bakers opened their shops and the smell of
fresh bread filled the streets. Children walked to school, and the old lighthouse keeper
climbed the stairs to clean the great lamp. In the evening the boats came back to the harbor,
and the families sat together to eat, to talk and to tell stories about the day.

Water boils at one hundred degrees Celsius at sea level. The sun is a star, and the earth
travels around it once every year. The moon reflects the light of the sun and changes its shape
during the month. Plants use sunlight, water and air to make sugar, and they give off oxygen.
Animals eat plants or other animals, and the energy moves through the food chain. Rivers carry
water from the mountains to the ocean, where it rises again as clouds and falls as rain.

What is your name? Where do you live? How many people are in your family? Please tell me about
your favorite book, your favorite song and the place you would most like to visit. I would like
to learn a new language this year. She said that the meeting will start at nine o'clock and end
before noon. They have been working on the project for three months, and they expect to finish
it next week. We should write the report today, because tomorrow is a holiday.

A computer stores numbers as bits. Eight bits make a byte, and a byte can hold a value between
zero and two hundred fifty five. Programs read input, process data and write output. A function
takes arguments and returns a result. A list keeps items in order, and a dictionary maps keys to
values. Memory is fast but small, while disks are large but slow. Networks connect machines so
they can send messages to each other. A good test checks one thing, runs quickly and gives the
same answer every time it runs.

The history of science is full of careful observation and patient work. Early astronomers
watched the night sky and recorded the positions of the planets. Later, physicists described
motion with simple laws, and chemists learned how elements combine to form new substances.
Doctors discovered that tiny living things can cause disease, and that clean water and soap
save many lives. Today, researchers share their results in journals and at conferences, and
other scientists try to repeat the experiments to see whether the results hold.

In the kitchen, mix two cups of flour with a spoon of salt and a cup of warm water. Knead the
dough for ten minutes, cover it and let it rest for an hour. Then shape the bread, put it in a
hot oven and bake it until the crust is golden and the loaf sounds hollow when you tap it.
Serve it with butter, cheese, honey or soup. Good food is simple food made with care.

The weather today is cold and windy, with a chance of rain in the afternoon. Tomorrow will be
warmer and sunny, with light winds from the south. On the weekend, the temperature will rise
again, and many people will go to the park, the beach or the mountains. Remember to bring water,
a hat and a jacket, because the weather can change quickly in the spring.

Question: What is two plus three? Answer: Two plus three is five.
Question: What color is the sky on a clear day? Answer: The sky is blue on a clear day.
Question: Which animal is known as the king of the jungle? Answer: The lion.
Question: How many days are there in a week? Answer: There are seven days in a week.
User: Can you help me plan a short trip? Assistant: Of course! Where would you like to go, and
how many days do you have? I can suggest places to stay, things to see and food to try.
"""


def build_tokenizer(model_vocab_size: int, model_max_length: int, full_vocab: bool = False,
                    tools: bool = False):
    """Byte-level BPE trained on _CORPUS, wrapped as a PreTrainedTokenizerFast.

    Byte-level means every UTF-8 string round-trips through encode/decode, including
    multibyte text the corpus never contained (it falls back to single-byte tokens).

    Ids that exist in the model (< vocab_size) but not in the tokenizer (>= len(tokenizer))
    can be produced by a random model.  ``tokenizer.decode`` does not raise on them: the Rust
    decoder looks each id up, finds no token and silently drops it, so such ids decode to ""
    (and ``convert_ids_to_tokens`` returns None for them).  Detokenizers must therefore
    tolerate ids that contribute no text.

    tools: add TOOL_TOKENS (non-special, after every trained id) and use Qwen's
    tool-calling template (QWEN_TOOLS_TEMPLATE) instead of plain ChatML.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    target = min(_MAX_TOKENIZER_VOCAB, model_vocab_size)
    # 256 byte symbols + the specials are the irreducible minimum of a byte-level BPE.
    floor = 256 + len(SPECIAL_TOKENS)
    if target < floor:
        raise ValueError(f"vocab_size must be >= {floor} for a byte-level tokenizer")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps encode(decode(x)) == x for text without a leading space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One "document" per line; the BPE trainer's merge order is fully determined by pair
    # counts with a deterministic tie-break, so the result is identical across processes.
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    assert tok.get_vocab_size() <= model_vocab_size
    if full_vocab:
        tok = extend_vocab(tok, model_vocab_size)
    if tools:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
        assert tok.get_vocab_size() <= model_vocab_size
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=QWEN_TOOLS_TEMPLATE if tools else CHATML_TEMPLATE,
        # The default cleanup rewrites " ." -> "." etc. and would break round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def extend_vocab(tok, size: int):
    """tok with vocabulary entries added up to `size` ids (see build_tokenizer)."""
    import json

    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    # "\u0120" is the byte-level alphabet's space: these decode to " w<id>".
    vocab.update({f"\u0120w{i}": i for i in range(tok.get_vocab_size(), size)})
    return Tokenizer.from_str(json.dumps(data))
