import unittest

from stack import Stack


class TestStack(unittest.TestCase):
    def test_push_pop(self):
        s = Stack()
        s.push(1)
        s.push(2)
        self.assertEqual(s.pop(), 2)

    def test_peek(self):
        s = Stack()
        s.push(3)
        self.assertEqual(s.peek(), 3)

    def test_peek_empty_raises(self):
        with self.assertRaises(IndexError):
            Stack().peek()


if __name__ == "__main__":
    unittest.main()
