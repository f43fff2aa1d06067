"""Questions for the chat demo's adapters, generated offline and
deterministically: templates filled with words from short lists. Held-out
questions use fillers that no training question uses."""

from __future__ import annotations

import random

COUNTRIES = ["Germany", "Italy", "Spain", "France", "Japan", "China", "India", "Brazil", "Canada", "Mexico", "Egypt",
             "Kenya", "Peru", "Chile", "Norway", "Sweden", "Poland", "Greece", "Turkey", "Portugal",
             "Ireland", "Australia", "Argentina", "Vietnam", "Thailand", "Nigeria", "Morocco", "Austria",
             "Belgium", "Finland", "Denmark", "Cuba"]
ANIMALS = ["cats", "dogs", "horses", "elephants", "lions", "tigers", "bees", "ants", "owls", "whales",
           "dolphins", "penguins", "frogs", "snakes", "rabbits", "foxes", "wolves", "bears", "eagles",
           "sharks", "octopuses", "camels", "giraffes", "zebras", "parrots", "turtles", "bats", "deer",
           "goats", "koalas", "otters", "squirrels"]
THINGS = ["rain", "snow", "a rainbow", "gravity", "a volcano", "the ocean", "the sun", "a star",
          "electricity", "music", "a computer", "a bicycle", "a library", "bread", "coffee", "tea",
          "chocolate", "a forest", "a desert", "a river", "an island", "a cloud", "thunder", "wind",
          "a mountain", "the internet", "a camera", "paper", "the moon", "a garden", "a clock", "salt"]
TASKS = ["make tea", "plant a tree", "bake bread", "tie a tie", "learn a language", "save money",
         "stay calm", "write a letter", "clean a window", "fix a flat tire", "make friends", "sleep better",
         "learn to cook", "start running", "grow tomatoes", "fold a shirt", "wash a car", "care for a plant",
         "read faster", "study for a test", "make pancakes", "keep a diary", "learn to draw", "pack a suitcase"]
ACTIVITIES = ["cooking", "running", "reading", "painting", "gardening", "swimming", "writing", "singing",
              "studying", "camping", "hiking", "chess", "photography", "knitting", "dancing", "cycling",
              "fishing", "baking", "yoga", "drawing", "skiing", "surfing", "sailing", "climbing"]

TEMPLATES = [
    ("What is the capital of {}?", COUNTRIES),
    ("What language is spoken in {}?", COUNTRIES),
    ("Tell me about {}.", ANIMALS),
    ("What do {} eat?", ANIMALS),
    ("Where do {} live?", ANIMALS),
    ("What is {}?", THINGS),
    ("Why is {} important?", THINGS),
    ("Write a sentence about {}.", THINGS),
    ("How do I {}?", TASKS),
    ("Give me a tip for {}.", ACTIVITIES),
    ("Why do people enjoy {}?", ACTIVITIES),
]
HELD_OUT_EVERY = 4  # every 4th filler of each list (France among them) is never trained on


def is_held_out(filler: str, words: list[str]) -> bool:
    return words.index(filler) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def questions(held_out: bool = False, seed: int = 0) -> list[str]:
    """Every training question (or every held-out one), in an order the seed shuffles."""
    out = [template.format(w) for template, words in TEMPLATES for w in words
           if is_held_out(w, words) == held_out]
    random.Random(seed).shuffle(out)
    return out
