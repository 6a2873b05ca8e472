"""What trainers read: the torch dataset over a build, and (coming) trainer export/import formats."""
