-- Keys are opaque identifiers: compare them byte by byte (COLLATE "C"), never by a locale.
-- Byte order is what equality means for a key, it is faster than a locale's collation in the
-- primary key's B-tree, and an index in "C" cannot be invalidated by an operating-system
-- upgrade that changes the locale's sort order (the glibc 2.28 problem).
-- On a large table this rewrites the table and its primary key under an exclusive lock: run
-- `idem migrate` in a quiet moment.
ALTER TABLE idempotency_keys
    ALTER COLUMN scope TYPE TEXT COLLATE "C",
    ALTER COLUMN operation TYPE TEXT COLLATE "C",
    ALTER COLUMN idem_key TYPE TEXT COLLATE "C";
