from collections import Counter


def count_words(text):
    return Counter(text.split())
