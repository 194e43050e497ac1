"""Train an EAGLE-3-style draft head for SmolLM2-135M on text SmolLM2 itself writes, on the CPU, and save it
as a head folder in the published EAGLE-3 layout (config.json + model.safetensors).

    python bench/train_eagle3.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--hf HF-FOLDER] [--work /tmp/decodert-eagle3]
                                 [--out ~/.cache/decodert-bench/smollm2-eagle3-head] [--prompts 4752] [--generator int4]
                                 [--gen 192] [--epochs 4] [--ttt 3] [--draft-vocab 8192] [--batch 4] [--threads 2]

Stages, each cached under --work (delete a file to redo that stage): ``target-int4/`` the decodert int4
export of the GGUF that writes the text (``target/``, fp32, with ``--generator fp32``), ``hf/`` transformers'
float32 view of the same GGUF (features), ``text-int4-GEN.json`` the prompts' greedy chat answers (decodert
``generate_many``, temperature 0), ``features-int4-GEN.pt`` the fp32 target's aux hidden states and its greedy
next token at every position (the labels). Training
then takes a few minutes an epoch on 2 cores; the head is written to --out with ``training.json``
(the data, the held-out acceptance per draft step) beside it.

Prompts: ``train_prompts()`` builds 4752 varied chat requests (templates x topics, how-to,
code and arithmetic requests: 3812; then 940 everyday-chat requests, ``CHAT``); every tenth is held out
(acceptance on ``val``). ``HELD_OUT`` are free-form prompts written apart from the lists (``free``): never
trained on (``CHAT`` shares some of their genres, none of their subjects); bench/eagle3_speed.py measures
end-to-end speed on them. ``HELD_OUT_2`` (``free2``) are in genres no list has.

The semantics (what the runtime must match; learnt from the EAGLE-3 paper and the published trainers'
and servers' descriptions, written here from scratch):

- **Aux features**: the target's residual stream at the *input* of decoder layers ``ids`` =
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` = [2, L//2, L-3] = [2, 15, 27] for SmolLM2's 30
  layers, i.e. transformers' ``hidden_states[i]`` (``hidden_states[0]`` is the embedding output), not
  normalised. Concatenated in that order: ``F_t = [h2_t | h15_t | h27_t]`` [3 * 576].
- **Step 0 (catch-up, every position the target computed)**: the pair (``F_t``, token ``x_{t+1}``) at
  RoPE position ``t``: ``g = fc(F_t)``; ``e = embed(x_{t+1})`` (the target's tied embedding, no scaling);
  ``a = [input_layernorm(e) | hidden_norm(g)]`` [2 * 576] feeds q/k/v; the residual is ``g`` itself (not
  normalised); ``r = g + o_proj(attn(a))``; ``h = r + mlp(post_attention_layernorm(r))``. ``h`` (before
  ``norm``) is the hidden state the next step feeds back; ``logits = lm_head(norm(h))`` over the draft
  vocabulary, predicting the target's token after ``x_{t+1}``. Attention is causal over the head's own
  K/V of positions 0..t (one layer, GQA 9 query / 3 K/V heads, head_dim 64, SmolLM2's RoPE theta).
- **Step k >= 1 (a drafted token)**: the pair (``h`` of the previous step, the token it drafted) at
  RoPE position ``n + k`` (``n`` = the last position the target computed), no fc; the query attends
  to the catch-up entries 0..n and the drafted steps' entries n+1..n+k (its own included). The drafted
  entries are scratch: the next catch-up (with the target's features of the accepted tokens) replaces them.
- **Draft vocabulary**: ``draft_vocab_size`` most frequent next tokens of the training text, sorted by
  target id; target id = draft id + ``d2t[draft id]``; ``t2d[target id]`` is True for tokens in it.
- **Training-time test**: each training sequence runs ``--ttt`` steps; step k at index t takes the head's
  step k-1 output at t and the true token ``x_{t+1+k}``, sits at RoPE position t+k, attends to step 0's
  keys 0..t and to the steps 1..k keys at index t (exactly the inference attention above), and learns
  the target's greedy token after ``x_{t+1+k}`` (loss weight 0.8^k, answer positions only). Where steps
  0..k-1 drafted right their inputs are the ones inference feeds, so the held-out "run length" (steps
  right in a row from step 0) is the number of drafts a verify pass would accept.

The speed-up estimate printed at the end assumes a verify pass of ``k + 1`` tokens costs ``--verify-cost``
decode steps and a drafted token ``--head-cost`` of one (SmolLM2 fp32 on 2 CPU cores: a verify of 4
tokens about 1.2 decode steps; the head's ~10 M weights against the target's 135 M): expected tokens per
pass / cost of a pass. bench/eagle3_speed.py measures the real thing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path.home() / ".cache" / "decodert-bench" / "smollm2-eagle3-head"
DEFAULT_WORK = Path("/tmp/decodert-eagle3")

TOPICS = [
    "volcanoes", "the moon", "honeybees", "the water cycle", "photosynthesis", "the Roman Empire", "electricity",
    "the human heart", "rainforests", "the printing press", "black holes", "friendship", "recycling", "dinosaurs",
    "the ocean tides", "vaccines", "the internet", "chess", "music", "earthquakes", "the solar system",
    "coffee", "ancient Egypt", "climate change", "bicycles", "the immune system", "rivers", "libraries",
    "gravity", "the Olympic Games", "penguins", "bread", "democracy", "trees", "robots", "the desert",
    "sleep", "mountains", "money", "the alphabet", "glaciers", "birds' migration", "the telephone",
    "bacteria", "kindness", "comets", "the Great Wall of China", "solar panels",
    # the second set (2026-12-07): broader subjects, none of HELD_OUT's
    "sharks", "the stock market", "airplanes", "the microscope", "elephants", "the Renaissance", "electric cars",
    "wind energy", "the periodic table", "DNA", "the Moon landing", "coral reefs", "volunteering",
    "the French Revolution", "origami", "the piano", "jazz", "whales", "ants", "spiders", "mushrooms", "cheese",
    "chocolate", "the Vikings", "castles", "samurai", "the Industrial Revolution", "steam engines", "trains",
    "bridges", "skyscrapers", "the compass", "maps", "satellites", "Mars", "Jupiter", "the Sun", "telescopes",
    "the speed of light", "sound", "atoms", "magnets", "algebra", "geometry", "prime numbers", "statistics",
    "computers", "programming", "video games", "social media", "artificial intelligence", "passwords",
    "smartphones", "batteries", "nuclear power", "plastic", "paper", "glass", "cotton", "farming", "wheat",
    "potatoes", "apples", "spices", "cats", "dogs", "horses", "owls", "butterflies", "frogs", "snakes",
    "polar bears", "Antarctica", "islands", "caves", "waterfalls", "lakes", "grasslands", "soil", "fossils",
    "diamonds", "gold", "the wheel", "writing", "calendars", "clocks", "museums", "theatre", "painting",
    "photography", "films", "novels", "fairy tales", "Greek mythology", "football", "tennis", "swimming",
    "yoga", "languages", "trade", "banks", "cities", "architecture", "gardens", "the human brain",
    "the skeleton", "the eye", "teeth", "blood", "the lungs", "digestion", "medicine", "first aid",
    "octopuses", "the Silk Road", "pirates", "knitting", "board games", "puzzles", "mathematics",
]
TEMPLATES = [
    "Explain {t} in simple terms.", "Write a short story about {t}.", "What are three interesting facts about {t}?",
    "Write a short poem about {t}.", "Why is {t} important?", "Describe {t} to someone who has never heard of it.",
    "Give me a brief history of {t}.", "What are common misconceptions about {t}?",
    "Write a paragraph for a school report on {t}.", "What would a curious child ask about {t}, and what would you answer?",
    "Tell me something surprising about {t}.", "How would you explain {t} to a ten-year-old?",
    "Write a dialogue between two friends talking about {t}.", "List five questions about {t}, with short answers.",
    "What can we learn from {t}?", "Summarise what everyone should know about {t}.",
    "Write a haiku about {t}, then explain it.", "How has {t} changed over time?",
    "Write an encyclopedia-style introduction to {t}.", "Compose a short speech about {t} for a school assembly.",
    "What jobs are connected to {t}?", "Imagine you are a museum guide. Introduce {t} to a group of visitors.",
]
HOW_TO = [
    "bake bread at home", "learn to swim as an adult", "start a vegetable garden", "write a good essay",
    "save money each month", "prepare for a job interview", "train for a 5 km run", "make a paper airplane",
    "learn a new language", "organise a small library", "care for a houseplant", "make friends in a new city",
    "fix a flat bicycle tire", "study for an exam", "write a thank-you letter", "plan a birthday party",
    "take better photos with a phone", "cook rice", "keep a journal", "improve my handwriting",
    "reduce food waste", "teach a dog to sit", "speak in public with confidence", "build a birdhouse",
    "set up a budget", "brew a cup of tea", "stay focused while working", "clean a wooden table",
    "change a light bulb safely", "write a CV", "learn to play the guitar", "make a fruit smoothie", "paint a room",
    "memorise a poem", "plant a tree", "choose a good book", "sew on a button", "make pancakes", "learn to draw",
    "be a better listener", "write a short story", "apologise to a friend", "learn to type faster",
    "start a podcast", "choose a laptop", "back up my files", "make pizza at home", "grow tomatoes", "fold a shirt",
    "tie a tie", "read faster", "set goals for the new year", "make a cup of coffee", "write a poem",
    "give a good presentation", "learn to juggle", "decorate a small room", "make a paper boat",
]
CODE = [
    "reverses a string", "checks whether a number is prime", "returns the largest item of a list",
    "counts the vowels in a word", "computes the factorial of n", "sorts a list of names alphabetically",
    "removes duplicates from a list", "converts Celsius to Fahrenheit", "returns the n-th Fibonacci number",
    "checks whether a word is a palindrome", "sums the digits of an integer", "merges two dictionaries",
    "finds the average of a list of numbers", "counts how often each word occurs in a sentence",
    "finds the second largest number in a list", "checks whether two words are anagrams", "flattens a nested list",
    "capitalises each word in a sentence", "returns the greatest common divisor of two numbers",
    "converts a binary string to an integer", "counts the lines in a text file", "returns the longest word in a sentence",
    "checks whether a year is a leap year", "returns the first n prime numbers", "computes the median of a list",
    "rotates a list by k positions", "removes punctuation from a string", "transposes a matrix",
    "finds an item in a sorted list with binary search", "converts a number to Roman numerals",
    "counts the words in a string", "returns the items two lists have in common", "sorts a list with bubble sort",
]
MATH = [
    "What is 17 times 23? Show your steps.", "A shop sells pens at 3 dollars each. How much do 14 pens cost?",
    "If a train travels 60 km in one hour, how far does it go in 3.5 hours?", "What is 25 percent of 240?",
    "Solve for x: 3x + 7 = 22.", "What is the area of a rectangle 8 m long and 5 m wide?",
    "A recipe needs 2 eggs for 4 people. How many eggs for 10 people?", "What is the sum of the first ten whole numbers?",
    "Convert 3 hours and 15 minutes to minutes.", "What is 144 divided by 12?",
]
MATH += [f"What is {a} times {b}? Show your steps." for a, b in ((12, 34), (46, 19), (75, 8), (103, 7), (58, 62))]
MATH += [f"What is {p} percent of {n}?" for p, n in ((15, 80), (40, 350), (12, 500), (75, 96))]
MATH += [f"Solve for x: {a}x - {b} = {c}." for a, b, c in ((5, 4, 21), (2, 9, 15), (7, 3, 46))]
MATH += [f"A box holds {a} apples. How many apples are in {b} boxes?" for a, b in ((12, 9), (24, 6), (18, 15))]
# The third set (2026-12-08): everyday-chat genres (habits, packing, a day in a job, what makes a good X, ideas,
# why, how a thing works, letters, stories with a character, differences, how a process goes), each with fills of
# its own and four phrasings. It shares genres with HELD_OUT, never a subject; HELD_OUT_2's genres are in no list.
CHAT = {
    "What are some good habits for {x}?": [
        "saving money", "studying", "sleeping well", "working from home", "learning an instrument", "keeping a tidy room",
        "writing every day", "staying focused at school", "reading more books", "looking after my eyes",
        "a new manager", "a healthy garden", "remembering names", "making the mornings easier", "using a computer safely",
        "keeping in touch with old friends", "running a small shop", "being on time", "learning to cook", "travelling cheaply"],
    "What should I pack for {x}?": [
        "a beach holiday", "a business trip", "a ski trip", "a long flight", "a music festival", "a school trip",
        "a day of hiking", "a visit to my grandparents", "a week in a big city", "a picnic in the park", "a fishing trip",
        "a first day at a new job", "a train journey across Europe", "a sailing weekend", "a sleepover", "a hospital stay",
        "a road trip with a dog", "a trip to the desert", "a cycling tour", "a winter holiday in the mountains"],
    "Describe a day in the life of {x}.": [
        "a baker", "a nurse", "an astronaut", "a farmer", "a zookeeper", "a firefighter", "a librarian", "a fisherman",
        "a chef", "a pilot", "a postman", "a gardener", "a beekeeper", "a train driver", "a museum curator", "a vet",
        "a street musician", "a bus driver", "a park ranger", "a shepherd", "a deep-sea diver", "a taxi driver",
        "a newspaper reporter", "a potter", "a mountain guide"],
    "What makes a good {x}?": [
        "leader", "friend", "doctor", "neighbour", "coach", "parent", "story", "city park", "manager", "team member",
        "student", "book", "breakfast", "holiday", "speech", "photograph", "password", "website", "restaurant", "song",
        "film", "board game", "job interview", "museum", "apology"],
    "Give me ideas for {x}.": [
        "a sunny Saturday", "a birthday present for my dad", "a school science fair", "a family dinner",
        "a quiet evening at home", "a picnic", "a class party", "a long car journey", "a snowy day with friends",
        "a small garden", "a short film", "a charity event", "a themed party", "a weekend in the countryside",
        "a cheap date", "a new hobby", "a blog post", "a school play", "a team-building day", "a healthy lunch box"],
    "Why do {x}?": [
        "cats purr", "we yawn", "stars twinkle", "onions make us cry", "birds sing in the morning", "we dream",
        "ice cubes float", "apples turn brown", "we get hiccups", "the seasons change", "balloons float", "dogs wag their tails",
        "we get goosebumps", "bubbles look round", "some people snore", "boats float", "fireflies glow", "bees make honey",
        "our voices sound different on recordings", "shadows change during the day"],
    "How does {x} work?": [
        "a microwave oven", "a washing machine", "a thermostat", "a bicycle gear", "a camera", "a lift", "a toaster",
        "a jet engine", "a lock and key", "a vacuum cleaner", "a light bulb", "a dishwasher", "a heat pump",
        "a touchscreen", "an electric kettle", "a parachute", "a hot-air balloon", "a wind turbine", "a pencil sharpener",
        "a smoke alarm", "a hearing aid", "a barcode scanner", "a traffic light", "a submarine", "a zip"],
    "Write a letter to {x}.": [
        "my grandmother about my new school", "a pen pal about my town", "my neighbour about a lost cat",
        "my future self about this year", "a friend about a book I loved", "the mayor about a new playground",
        "a company about a broken toaster", "my teacher to say thank you", "a new student to welcome them",
        "an author I admire", "my brother who moved abroad", "a local newspaper about litter", "a hotel about my stay",
        "a friend who is in hospital", "my landlord about a leaking tap", "a zoo asking to visit as a class",
        "a football club about tickets", "a scientist about their discovery", "my old school about a reunion",
        "a shop about an order that never came"],
    "Tell me a short story about {x}.": [
        "a robot who learns to paint", "a cat who wants to fly", "a young wizard who loses his wand",
        "a brave mouse who saves a village", "an old sailor who finds a map", "a shy giraffe who joins a band",
        "a snowman who visits the city", "a knight who is afraid of the dark", "a girl who can talk to trees",
        "a clock that stops time", "a lost puppy in a big city", "two rival bakers", "a boy who builds a rocket",
        "a turtle who wants to win a race", "a ghost who is lonely", "a princess who becomes a detective",
        "a farmer and a magic seed", "a fox who opens a café", "a star that falls into a garden", "a forgetful giant"],
    "What is the difference between {x}?": [
        "a virus and a bacterium", "a lake and a pond", "speed and velocity", "a frog and a toad",
        "a comet and an asteroid", "a crocodile and an alligator", "a hurricane and a tornado", "a fruit and a vegetable",
        "a city and a town", "an ocean and a sea", "a poem and a song", "a monkey and an ape", "a rabbit and a hare",
        "a moth and a butterfly", "a cold and the flu", "a loan and a gift", "a mountain and a hill",
        "a planet and a star", "a novel and a short story", "a canoe and a kayak"],
    "Explain how {x}.": [
        "a seed grows into a tree", "a letter travels through the post", "an election works", "a rainbow forms",
        "bread rises", "a caterpillar becomes a butterfly", "a court trial works", "a bank loan works",
        "a city gets its clean water", "a book gets published", "a cake bakes in the oven", "a cloud makes rain",
        "a plane stays in the air", "a wound heals", "a mobile phone call reaches another person", "paper is made",
        "a newspaper is printed", "a river shapes a valley", "cheese is made", "a ship finds its way at sea"],
}
CHAT_PHRASINGS = ["{q}", "{q} Keep it short.", "{q} Please answer in a friendly way.", "Quick question: {q}"]
# Free-form prompts written apart from the lists above: never trained on (bench/eagle3_speed.py times them).
HELD_OUT = [
    "What are some good habits for staying healthy?", "Tell me a short story about a dragon who learns to cook.",
    "Why do leaves change colour in autumn?", "How does a refrigerator keep food cold?",
    "Write a letter to a friend about your summer holiday.", "What should I pack for a weekend camping trip?",
    "Describe a day in the life of a lighthouse keeper.", "What makes a good teacher?",
    "Explain how a bill becomes a law.", "Give me ideas for a rainy afternoon with kids.",
    "Why is the sky blue?", "What is the difference between weather and climate?",
]


# Free-form prompts in genres no list above has (reported beside HELD_OUT; never trained on).
HELD_OUT_2 = [
    "Plan a three-day trip to Lisbon.", "What are the pros and cons of working in an open-plan office?",
    "Write a product description for a reusable water bottle.", "Suggest a weekly meal plan for a student.",
    "Write a riddle and give its answer.", "Write a review of an imaginary seaside restaurant.",
    "What questions should I ask when buying a used car?", "Create a simple workout plan for beginners.",
    "Write a limerick about a forgetful cat.", "Summarise the plot of a made-up detective novel.",
    "Argue for and against school uniforms.", "Write a job advert for a lifeguard.",
]

def train_prompts() -> list[str]:
    """Every built-in training prompt, in a fixed shuffled order (so --prompts N takes a mix of every kind)."""
    prompts = [t.format(t=topic) for topic in TOPICS for t in TEMPLATES]
    prompts += [f"How do I {h}?" for h in HOW_TO] + [f"Write a Python function that {c}." for c in CODE] + MATH
    random.Random(49).shuffle(prompts)  # fixed seed: the same order in every run
    chat = [f.format(q=q.format(x=x)) for q, fills in CHAT.items() for x in fills for f in CHAT_PHRASINGS]
    random.Random(50).shuffle(chat)  # after the first sets: their every-tenth validation split stays as it was
    return prompts + chat


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- stage 1-2: the target, and the text it writes -------------------------------------------------------
def generator_tag(generator: str) -> str:
    """The part of the cached stages' names that says which export wrote the text (none for fp32, the old path)."""
    return "" if generator == "fp32" else f"-{generator}"


def target_artifact(gguf: Path, work: Path, generator: str = "int4") -> Path:
    """The decodert export that writes the training text: ``int4`` (the default: 16 rows at a time on the
    fastest decode step the placement finds, ~450 tok/s on 2 cores against ~60 for fp32 at batch 8) or
    ``fp32``. The labels are transformers' fp32 greedy tokens either way (stage 3)."""
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    folder = work / f"target{generator_tag(generator)}"
    if not (folder / "manifest.json").is_file():
        quant = QuantConfig(bits=4, accuracy_level=4) if generator == "int4" else None
        export_model(gguf, folder, max_seq=1024, max_batch=16 if quant else 8, progress=False, quant=quant)
    return folder


def generate_text(target: Path, prompts: list[str], gen: int, path: Path) -> list[dict]:
    """Each prompt's chat-templated ids and SmolLM2's greedy answer (cached in ``path``)."""
    cached = json.loads(path.read_text()) if path.is_file() else []
    done = {r["prompt"] for r in cached}
    todo = [p for p in prompts if p not in done]
    if todo:
        from decodert.runtime.decoding.sampling import SamplingParams
        from decodert.runtime.llm import LLM, Request

        llm = LLM.load(target, backend="ort", placement="auto")
        chat = lambda text: llm.encode(llm.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)  # noqa: E731
        t0, tokens = time.perf_counter(), 0
        for i in range(0, len(todo), 64):  # in chunks, cached as they finish
            part = todo[i:i + 64]
            ids = [chat(p).tolist() for p in part]
            rs = llm.generate_many([Request(p, SamplingParams(max_new_tokens=gen, temperature=0.0)) for p in ids])
            cached += [{"prompt": p, "ids": q, "answer": list(map(int, r.token_ids))} for p, q, r in zip(part, ids, rs)]
            tokens += sum(len(r.token_ids) for r in rs)
            path.write_text(json.dumps(cached))
            log(f"  generated {len(cached)} answers, {tokens / (time.perf_counter() - t0):.0f} tok/s")
        llm.close()
    by_prompt = {r["prompt"]: r for r in cached}
    return [by_prompt[p] for p in prompts]


# ---- stage 3: the target's features ----------------------------------------------------------------
def aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default choice: a low, a middle and a high layer's input."""
    return [2, num_layers // 2, num_layers - 3]


def collect_features(hf_folder: Path, rows: list[dict], layer_ids: list[int]) -> list[dict]:
    """Per row: ids [T], aux features [T, 3H] (fp16), the target's greedy next token [T], the answer mask [T]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype="float32").eval()
    out = []
    with torch.inference_mode():
        for r in rows:
            ids = torch.tensor([r["ids"] + r["answer"]])
            o = model(ids, output_hidden_states=True)
            feats = torch.cat([o.hidden_states[i][0] for i in layer_ids], dim=-1)
            mask = torch.zeros(ids.shape[1], dtype=torch.bool)
            mask[len(r["ids"]) - 1:] = True  # the positions whose next token the target wrote (its greedy answer)
            out.append({"ids": ids[0], "feats": feats.half(), "next": o.logits[0].argmax(-1), "mask": mask})
    return out


def feature_agreement(features: list[dict], rows: list[dict]) -> float:
    """Share of answer tokens that transformers' greedy token (the labels) agrees with decodert's."""
    same = total = 0
    for f, r in zip(features, rows):
        n = len(r["ids"])
        pred = f["next"][n - 1:-1].tolist()  # the prediction at each position before an answer token
        same += sum(int(a == b) for a, b in zip(pred, r["answer"]))
        total += len(r["answer"])
    return same / max(total, 1)


# ---- stage 4: the head ---------------------------------------------------------------------------------
def make_head(cfg: dict, embed, final_norm, keep):
    """The head as a torch module named like the published layout; lm_head starts as the target's tied
    embedding rows of the draft tokens (the map the target's own last layer reads through), norm as a tenth of
    its final norm."""
    import torch
    from torch import nn

    H, nh, nkv, hd, inter = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                             cfg["head_dim"], cfg["intermediate_size"])

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(H))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    def linear(i, o):
        return nn.Linear(i, o, bias=False)

    head = nn.Module()
    head.fc = linear(3 * H, H)
    mid = head.midlayer = nn.Module()
    mid.input_layernorm, mid.hidden_norm, mid.post_attention_layernorm = Norm(), Norm(), Norm()
    attn = mid.self_attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = linear(2 * H, nh * hd), linear(2 * H, nkv * hd), linear(2 * H, nkv * hd)
    attn.o_proj = linear(nh * hd, H)
    mlp = mid.mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = linear(H, inter), linear(H, inter), linear(inter, H)
    head.norm = Norm()
    head.lm_head = linear(H, len(keep))
    with torch.no_grad():
        head.lm_head.weight.copy_(embed[keep])
        head.norm.weight.copy_(final_norm * 0.1)  # a cool start: logits of std ~0.6, not ~6 (a loss of 8, not 16)
    return head


def rope(positions, hd: int, theta: float):
    """cos, sin [.., hd] of RoPE (the rotate-half pairing Llama uses) at ``positions``."""
    import torch

    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def ttt_forward(head, cfg: dict, embed, feats, ids, steps: int):
    """Training-time test over a right-padded batch: logits [steps][B, L, Vd] with L = T - 1; step k at
    index t is the pair (step k-1's h at t, x[t+1+k]) at RoPE position t+k (docstring of this file)."""
    import torch
    import torch.nn.functional as F

    B, T = ids.shape
    L = T - 1
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    mid, attn = head.midlayer, head.midlayer.self_attn
    pad = torch.zeros(B, steps, dtype=ids.dtype)
    tokens = torch.cat([ids, pad], dim=1)  # x[t+1+k] past the end: padding (its labels are masked)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    h = head.fc(feats[:, :L].float())  # [B, L, H]
    keys, values, logits = [], [], []
    for k in range(steps):
        e = embed[tokens[:, 1 + k:1 + k + L]]  # [B, L, H]
        a = torch.cat([mid.input_layernorm(e), mid.hidden_norm(h)], dim=-1)  # [B, L, 2H]
        cos, sin = rope(torch.arange(L) + k, hd, cfg["rope_theta"])
        q = rotate(attn.q_proj(a).view(B, L, nh, hd).transpose(1, 2), cos, sin)  # [B, nh, L, hd]
        kk = rotate(attn.k_proj(a).view(B, L, nkv, hd).transpose(1, 2), cos, sin).repeat_interleave(nh // nkv, 1)
        vv = attn.v_proj(a).view(B, L, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        keys.append(kk)
        values.append(vv)
        scale = 1.0 / math.sqrt(hd)
        s0 = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, nh, L, L]
        diag = [(q * keys[j]).sum(-1, keepdim=True) * scale for j in range(1, k + 1)]  # [B, nh, L, 1] each
        p = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
        o = p[..., :L] @ values[0]
        for j in range(1, k + 1):
            o = o + p[..., L + j - 1:L + j] * values[j]
        r = h + attn.o_proj(o.transpose(1, 2).reshape(B, L, nh * hd))
        m = mid.mlp
        h = r + m.down_proj(F.silu(m.gate_proj(mid.post_attention_layernorm(r))) * m.up_proj(mid.post_attention_layernorm(r)))
        logits.append(head.lm_head(head.norm(h)))
    return logits


def step_labels(batch: dict, steps: int, t2d_index):
    """Per step k: the target's token after x[t+1+k] as a draft id (-1: outside the draft vocabulary) and
    whether it counts (an answer position inside the row)."""
    import torch

    nxt, mask, lengths = batch["next"], batch["mask"], batch["lengths"]
    B, T = nxt.shape
    L = T - 1
    idx = torch.arange(L)
    out = []
    for k in range(steps):
        pos = idx + 1 + k  # the position whose next token step k predicts
        inside = pos[None, :] < lengths[:, None]
        posc = pos.clamp(max=T - 1)
        tgt = nxt[:, posc]
        valid = inside & mask[:, posc]
        out.append((tgt, t2d_index[tgt], valid))
    return out


def batches(features: list[dict], size: int, shuffle: random.Random | None):
    import torch

    order = sorted(range(len(features)), key=lambda i: len(features[i]["ids"]))  # similar lengths together
    groups = [order[i:i + size] for i in range(0, len(order), size)]
    if shuffle:
        shuffle.shuffle(groups)
    for g in groups:
        rows = [features[i] for i in g]
        T = max(len(r["ids"]) for r in rows)

        def stack(key, fill=0):
            x = rows[0][key]
            out = torch.full((len(rows), T) + tuple(x.shape[1:]), fill, dtype=x.dtype)
            for i, r in enumerate(rows):
                out[i, :len(r[key])] = r[key]
            return out

        yield {"ids": stack("ids"), "feats": stack("feats"), "next": stack("next"), "mask": stack("mask", False),
               "lengths": torch.tensor([len(r["ids"]) for r in rows])}


def evaluate(head, cfg, embed, features, steps, t2d_index, d2t_target, size: int = 8) -> dict:
    """Held-out acceptance per draft step, teacher-forced: ``step_acc[k]`` = share of positions whose step-k
    draft is the target's token given steps 0..k-1 were right; ``accepted[k]`` = mean drafts accepted per
    verify pass drafting k + 1 tokens (steps right in a row from step 0)."""
    import torch

    right_at = [0] * steps
    seen_at = [0] * steps
    runs = [0.0] * steps
    n_pos = 0
    with torch.inference_mode():
        for b in batches(features, size, None):
            logits = ttt_forward(head, cfg, embed, b["feats"], b["ids"], steps)
            labels = step_labels(b, steps, t2d_index)
            base = labels[0][2]  # positions where step 0 counts
            alive = base.clone()
            run = torch.zeros_like(base, dtype=torch.float32)
            for k in range(steps):
                tgt, _, valid = labels[k]
                ok = (d2t_target[logits[k].argmax(-1)] == tgt) & valid
                seen_at[k] += int((alive & valid).sum())
                right_at[k] += int((alive & ok).sum())
                alive = alive & ok
                run += alive.float()
                runs[k] += float(run[base].sum())
            n_pos += int(base.sum())
    return {"positions": n_pos, "step_acc": [r / max(s, 1) for r, s in zip(right_at, seen_at)],
            "accepted": [r / max(n_pos, 1) for r in runs]}


def train(head, cfg, embed, features, val, args, t2d_index, d2t_target) -> list[dict]:
    import torch
    import torch.nn.functional as F

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = args.epochs * math.ceil(len(features) / args.batch)
    warm = max(1, min(30, total // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i / total, 1.0))))
    rng = random.Random(args.seed)
    history = []
    for epoch in range(args.epochs):
        t0, seen, loss_sum = time.perf_counter(), 0, 0.0
        head.train()
        for b in batches(features, args.batch, rng):
            logits = ttt_forward(head, cfg, embed, b["feats"], b["ids"], args.ttt)
            loss = torch.zeros(())
            for k, (lg, (_, dl, valid)) in enumerate(zip(logits, step_labels(b, args.ttt, t2d_index))):
                use = valid & (dl >= 0)
                if use.any():
                    loss = loss + 0.8 ** k * F.cross_entropy(lg[use], dl[use])
            if not loss.requires_grad:  # no answer position in this batch
                continue
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            seen += 1
            loss_sum += float(loss.detach()) if torch.is_tensor(loss) else 0.0
        head.eval()
        ev = evaluate(head, cfg, embed, val, args.ttt, t2d_index, d2t_target) if val else {}
        history.append({"epoch": epoch + 1, "loss": loss_sum / max(seen, 1), "seconds": time.perf_counter() - t0, **ev})
        log(f"  epoch {epoch + 1}: loss {loss_sum / max(seen, 1):.3f}, {time.perf_counter() - t0:.0f} s, "
            f"val step acc {fmt(ev.get('step_acc', []))}, accepted/pass {fmt(ev.get('accepted', []))}")
    return history


def fmt(xs) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


# ---- stage 5: the folder ------------------------------------------------------------------------------
def draft_vocab(features: list[dict], size: int, vocab: int):
    """The ``size`` most frequent next tokens of the answers, sorted by id; d2t [size] int64, t2d [vocab] bool."""
    import torch

    counts = torch.zeros(vocab, dtype=torch.int64)
    for f in features:
        counts += torch.bincount(f["next"][f["mask"]], minlength=vocab)
    keep = counts.argsort(descending=True)[:size].sort().values
    d2t = keep - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    coverage = float(counts[keep].sum()) / max(int(counts.sum()), 1)
    return keep, d2t, t2d, coverage


def vocab_coverage(features: list[dict], t2d) -> float:
    """The fraction of the answers' next tokens a draft vocabulary (t2d [vocab] bool) holds."""
    held = total = 0
    for f in features:
        nxt = f["next"][f["mask"]]
        held, total = held + int(t2d[nxt].sum()), total + len(nxt)
    return held / max(total, 1)


def head_config(target_cfg: dict, draft_size: int, layer_ids: list[int]) -> dict:
    rope_theta = (target_cfg.get("rope_parameters") or {}).get("rope_theta", target_cfg.get("rope_theta", 10000.0))
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": target_cfg["hidden_size"], "intermediate_size": target_cfg["intermediate_size"],
        "num_attention_heads": target_cfg["num_attention_heads"], "num_key_value_heads": target_cfg["num_key_value_heads"],
        "head_dim": target_cfg.get("head_dim", target_cfg["hidden_size"] // target_cfg["num_attention_heads"]),
        "num_hidden_layers": 1, "rms_norm_eps": target_cfg["rms_norm_eps"], "rope_theta": rope_theta,
        "max_position_embeddings": target_cfg["max_position_embeddings"], "vocab_size": target_cfg["vocab_size"],
        "draft_vocab_size": draft_size, "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": target_cfg.get("bos_token_id"), "eos_token_id": target_cfg.get("eos_token_id"),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    }


def save_head(head, cfg: dict, d2t, t2d, out: Path, extra: dict) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in head.state_dict().items()}
    tensors["d2t"] = d2t.to(torch.int64).contiguous()
    tensors["t2d"] = t2d.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(extra, indent=2) + "\n")


def estimate(accepted: list[float], verify_cost: float, head_cost: float) -> list[float]:
    """Speed-up over plain decoding per draft length k = 1..: (1 + accepted drafts) / (verify + k heads)."""
    return [(1 + a) / (verify_cost + (k + 1) * head_cost) for k, a in enumerate(accepted)]


# ---- main -----------------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="SmolLM2 GGUF (default: the one decodert's tests use)")
    p.add_argument("--hf", type=Path, default=None, help="an HF folder of the same weights instead of converting the GGUF")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--prompts", type=int, default=len(train_prompts()), help="training prompts used (default: all built-in ones)")
    p.add_argument("--gen", type=int, default=192, help="max answer tokens")
    p.add_argument("--generator", choices=("int4", "fp32"), default="int4", help="the export that writes the text")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--ttt", type=int, default=3, help="training-time-test steps (draft steps trained)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init", type=Path, default=None,
                   help="go on training this head folder (one this script wrote; it keeps its draft vocabulary) instead of a new head")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=49)
    p.add_argument("--verify-cost", type=float, default=1.2, help="a verify pass in decode steps (the estimate)")
    p.add_argument("--head-cost", type=float, default=0.08, help="a drafted token in decode steps (the estimate)")
    args = p.parse_args(argv)
    for name in ("prompts", "gen", "epochs", "ttt", "batch", "draft_vocab", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("DECODERT_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sys.path.insert(0, str(Path(__file__).parent))
    args.work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    prompts = train_prompts()
    if args.prompts > len(prompts):
        log(f"  only {len(prompts)} built-in prompts: using all of them")
    prompts = prompts[:args.prompts]
    assert not set(prompts) & set(HELD_OUT + HELD_OUT_2)
    if args.gguf is None:
        from decodert.export.fetch import smollm2_gguf

        args.gguf = smollm2_gguf()
    target = target_artifact(args.gguf, args.work, args.generator)
    t0 = time.perf_counter()
    text = args.work / f"text{generator_tag(args.generator)}-{args.gen}.json"
    rows = generate_text(target, HELD_OUT + HELD_OUT_2 + prompts, args.gen, text)  # held-out first: cached first
    t_gen = time.perf_counter() - t0
    log(f"text: {len(rows)} answers, {sum(len(r['answer']) for r in rows)} tokens ({t_gen:.0f} s)")

    if args.hf is None:
        from competitors import make_hf_folder

        args.hf = make_hf_folder(args.gguf, args.work / "hf")
    target_cfg = json.loads((args.hf / "config.json").read_text())
    layer_ids = aux_layer_ids(target_cfg["num_hidden_layers"])
    feat_path = args.work / f"features{generator_tag(args.generator)}-{args.gen}.pt"
    t0 = time.perf_counter()
    cached = torch.load(feat_path) if feat_path.is_file() else {}
    if cached.get("layer_ids") != layer_ids:
        cached = {"layer_ids": layer_ids, "by_prompt": {}}
    todo = [r for r in rows if r["prompt"] not in cached["by_prompt"]]
    if todo:  # per prompt, so a shorter run's features serve a longer one
        cached["by_prompt"].update(zip([r["prompt"] for r in todo], collect_features(args.hf, todo, layer_ids)))
        torch.save(cached, feat_path)
    features = [cached["by_prompt"][r["prompt"]] for r in rows]
    t_feat = time.perf_counter() - t0
    agree = feature_agreement(features, rows)
    log(f"features: layers {layer_ids} ({t_feat:.0f} s); transformers' greedy tokens = decodert's at {agree:.4f} of answer tokens")

    n_train, n_free, n_free2 = len(prompts), len(HELD_OUT), len(HELD_OUT_2)
    free_rows, free2_rows = features[:n_free], features[n_free:n_free + n_free2]
    ours = features[n_free + n_free2:]
    train_rows = [f for i, f in enumerate(ours) if i % 10 != 9]
    val_rows = [f for i, f in enumerate(ours) if i % 10 == 9]  # every tenth prompt: held out
    V = target_cfg["vocab_size"]
    keep, d2t, t2d, coverage = draft_vocab(train_rows, min(args.draft_vocab, V), V)
    from safetensors.torch import load_file

    start = None
    if args.init is not None:  # going on: the head keeps its own draft vocabulary (this data's coverage reported)
        start = load_file(str(args.init / "model.safetensors"))
        if start["t2d"].shape != t2d.shape or start["d2t"].shape != d2t.shape:
            raise SystemExit(f"--init {args.init}: its draft vocabulary has another size (--draft-vocab) or target")
        t2d = start.pop("t2d")
        keep = t2d.nonzero().flatten()
        d2t = start.pop("d2t")
        coverage = vocab_coverage(train_rows, t2d)
    t2d_index = torch.full((V,), -1, dtype=torch.int64)
    t2d_index[keep] = torch.arange(len(keep))
    log(f"draft vocabulary: {len(keep)} tokens, {coverage:.4f} of the training answers' next tokens")

    weights = load_file(str(args.hf / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"].float()
    cfg = head_config(target_cfg, len(keep), layer_ids)
    head = make_head(cfg, embed, weights["model.norm.weight"].float(), keep)
    del weights
    if start is not None:
        head.load_state_dict(start)
        log(f"  going on from {args.init}")
    t0 = time.perf_counter()
    history = train(head, cfg, embed, train_rows, val_rows, args, t2d_index, keep)
    t_train = time.perf_counter() - t0
    free = evaluate(head, cfg, embed, free_rows, args.ttt, t2d_index, keep)
    free2 = evaluate(head, cfg, embed, free2_rows, args.ttt, t2d_index, keep)
    val = history[-1] if history else {}
    est = estimate(free["accepted"], args.verify_cost, args.head_cost)
    extra = {"prompts": n_train, "init": str(args.init) if args.init else None, "train_rows": len(train_rows),
             "val_rows": len(val_rows), "free_rows": len(free_rows), "free2_rows": len(free2_rows),
             "answer_tokens": sum(len(r["answer"]) for r in rows), "draft_vocab_coverage": coverage,
             "transformers_decodert_agreement": agree, "epochs": args.epochs, "ttt": args.ttt, "lr": args.lr,
             "history": history, "free": free, "free2": free2, "seconds": {"generate": t_gen, "features": t_feat, "train": t_train,
                                                          "total": time.perf_counter() - t_all}}
    save_head(head, cfg, d2t, t2d, args.out, extra)
    log(f"held-out (val, {val.get('positions', 0)} positions): step acc {fmt(val.get('step_acc', []))}, "
        f"accepted/pass {fmt(val.get('accepted', []))}")
    log(f"held-out free-form ({free['positions']} positions): step acc {fmt(free['step_acc'])}, "
        f"accepted/pass {fmt(free['accepted'])}")
    log(f"held-out free-form, genres in no training list ({free2['positions']} positions): step acc "
        f"{fmt(free2['step_acc'])}, accepted/pass {fmt(free2['accepted'])}")
    log(f"estimated speed-up for k = 1..{args.ttt} drafts (verify {args.verify_cost}, head {args.head_cost} decode steps): {fmt(est)}")
    log(f"head written to {args.out} ({time.perf_counter() - t_all:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
