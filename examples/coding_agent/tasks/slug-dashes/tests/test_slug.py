import unittest

from slug import slugify


class TestSlug(unittest.TestCase):
    def test_lower(self):
        self.assertEqual(slugify("Hello"), "hello")

    def test_collapse(self):
        self.assertEqual(slugify("a  --  b"), "a-b")

    def test_trim(self):
        self.assertEqual(slugify(" Hi! "), "hi")


if __name__ == "__main__":
    unittest.main()
