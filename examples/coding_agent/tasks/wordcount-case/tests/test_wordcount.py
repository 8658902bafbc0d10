import unittest

from wordcount import count_words


class TestWordcount(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(count_words("a b a")["a"], 2)

    def test_case(self):
        self.assertEqual(count_words("The the THE"), {"the": 3})


if __name__ == "__main__":
    unittest.main()
