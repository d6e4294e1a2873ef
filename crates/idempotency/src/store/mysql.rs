//! MySQL / MariaDB store (feature `mysql`): to be written.
