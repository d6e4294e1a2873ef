//! A posted form's fields, read once by the CSRF check and handed to the handler.

/// The fields of an `application/x-www-form-urlencoded` body, in order (a name may repeat).
#[derive(Debug, Clone, Default)]
pub struct Fields(Vec<(String, String)>);

impl Fields {
    /// Decodes `body`; an undecodable body has no fields.
    pub fn parse(body: &[u8]) -> Self {
        Self(serde_urlencoded::from_bytes(body).unwrap_or_default())
    }

    /// The first value of `name`, if present.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first value of `name`, trimmed; empty when absent.
    pub fn text(&self, name: &str) -> &str {
        self.get(name).map(str::trim).unwrap_or("")
    }

    /// Every value of `name`, in order.
    pub fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Fields;

    #[test]
    fn reads_repeated_and_escaped_fields() {
        let fields = Fields::parse(b"k=a%20b&csrf=x&k=c+d&reason=+why+");
        assert_eq!(fields.all("k").collect::<Vec<_>>(), ["a b", "c d"]);
        assert_eq!(fields.get("csrf"), Some("x"));
        assert_eq!(fields.text("reason"), "why");
        assert_eq!(fields.text("missing"), "");
        assert!(Fields::parse(b"%zz=\xff").get("x").is_none());
    }
}
