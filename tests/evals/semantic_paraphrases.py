"""A paraphrase set for the response cache's semantic match, written for this project: pairs of user questions, each
either the same question in other words (a hit is right) or a question that differs from the other in the one word
its answer hangs on, a name, a number, a negation, a unit, a direction (a hit is a wrong answer served).

Kept small and readable on purpose: it measures what a threshold costs, on text like a support desk's and an
assistant's, not a benchmark's."""

from __future__ import annotations

# (first, second): the same question
PARAPHRASES: list[tuple[str, str]] = [
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How do I reset my password?", "How can I reset my password?"),
    ("What time does the store open on Saturday?", "When does the store open on Saturdays?"),
    ("Can you summarise this article in three sentences?", "Please summarize this article in three sentences."),
    ("How many days are there in a leap year?", "How many days does a leap year have?"),
    ("Translate 'good morning' into Spanish.", "How do you say 'good morning' in Spanish?"),
    ("What is the boiling point of water at sea level?", "At sea level, what temperature does water boil at?"),
    ("How do I cancel my subscription?", "What are the steps to cancel my subscription?"),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?"),
    ("Give me a recipe for pancakes.", "Can you give me a pancake recipe?"),
    ("What's the difference between a list and a tuple in Python?", "How does a Python list differ from a tuple?"),
    ("Is it going to rain tomorrow in London?", "Will it rain in London tomorrow?"),
    ("How do I change the email address on my account?", "How can I update my account's email address?"),
    ("Explain what a hash function is.", "What is a hash function? Please explain."),
    ("What are the opening hours of the museum?", "When is the museum open?"),
    ("How long does shipping take to Canada?", "How many days does delivery to Canada take?"),
    ("Write a haiku about autumn leaves.", "Compose a haiku about the leaves in autumn."),
    ("What does HTTP stand for?", "What is HTTP short for?"),
    ("How do I convert Celsius to Fahrenheit?", "What's the formula to convert Celsius into Fahrenheit?"),
    ("Recommend a good book about history.", "Can you recommend a good history book?"),
]

# (first, second): questions whose right answers differ
NEAR_MISSES: list[tuple[str, str]] = [
    ("What is the capital of France?", "What is the capital of Germany?"),
    ("How do I reset my password?", "How do I reset my username?"),
    ("What time does the store open on Saturday?", "What time does the store close on Saturday?"),
    ("Can you summarise this article in three sentences?", "Can you summarise this article in ten sentences?"),
    ("How many days are there in a leap year?", "How many weeks are there in a leap year?"),
    ("Translate 'good morning' into Spanish.", "Translate 'good morning' into German."),
    ("What is the boiling point of water at sea level?", "What is the freezing point of water at sea level?"),
    ("How do I cancel my subscription?", "How do I renew my subscription?"),
    ("Who wrote Pride and Prejudice?", "Who wrote War and Peace?"),
    ("Give me a recipe for pancakes.", "Give me a recipe for waffles."),
    ("Is it going to rain tomorrow in London?", "Is it going to rain tomorrow in Paris?"),
    ("How do I change the email address on my account?", "How do I delete the email address on my account?"),
    ("What are the opening hours of the museum?", "What are the opening hours of the library?"),
    ("How long does shipping take to Canada?", "How long does shipping take to Australia?"),
    ("Write a haiku about autumn leaves.", "Write a haiku about spring flowers."),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?"),
    ("Is this medicine safe to take with alcohol?", "Is this medicine unsafe to take with alcohol?"),
    ("What is 15% of 200?", "What is 25% of 200?"),
    ("Should I buy the stock now?", "Should I sell the stock now?"),
    ("Does the hotel allow pets?", "Does the hotel not allow pets?"),
]
