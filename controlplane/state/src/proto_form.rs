//! A domain value's protobuf form ([`ProtoForm`]): how it converts to the
//! message generated from `proto/` and back, and which entry format
//! version its encoding needs.
//!
//! Most types derive it (`#[derive(keel_proto_derive::ProtoForm)]`, field
//! by field, by name); the impls here cover what fields are made of
//! (numbers, strings, bytes, lists, maps, optional and required
//! messages), and the few types whose protobuf form is shaped otherwise
//! implement it by hand ([`crate::codec`]). So a field added to a command
//! and its message is converted, checked and versioned without code of its
//! own: the field, its `#[proto(since = N)]` when older builds must refuse
//! it, and nothing else (ARCHITECTURE.md, "What one new field costs").

use std::collections::BTreeMap;

use crate::codec::DecodeError;

pub use keel_proto_derive::ProtoForm;

/// The first entry format version: what every entry needs at least.
pub const FIRST: u32 = 1;

/// A domain type's conversion to and from its protobuf form `P`.
pub trait ProtoForm<P>: Sized {
    fn to_proto(&self) -> P;
    /// Refuses what the domain cannot hold (a missing required message, an
    /// unknown enum value), naming `field` (`message.field`). Range and
    /// consistency checks are `apply`'s and the specs' `validate`, not
    /// this.
    fn from_proto(p: P, field: &'static str) -> Result<Self, DecodeError>;
    /// The oldest entry format version that expresses `p`: a build reading
    /// only older versions would drop one of its fields.
    fn version_of(_p: &P) -> u32 {
        FIRST
    }
}

/// The newest entry format version a type's fields were added in.
pub trait Versions {
    const NEWEST: u32;
}

/// A type whose protobuf form is a message: a field holding one is
/// `Option<P>` in prost, and required (missing is an error) unless the
/// domain field is an `Option` too.
pub trait Message {}

/// `max` usable in a constant.
pub const fn max(a: u32, b: u32) -> u32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Whether a protobuf field holds its default, so is not on the wire.
pub fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

macro_rules! as_itself {
    ($($t:ty),*) => {$(
        impl ProtoForm<$t> for $t {
            fn to_proto(&self) -> $t {
                self.clone()
            }
            fn from_proto(p: $t, _field: &'static str) -> Result<Self, DecodeError> {
                Ok(p)
            }
        }
        impl Versions for $t {
            const NEWEST: u32 = FIRST;
        }
    )*};
}

as_itself!(u64, u32, i64, i32, f64, f32, bool, String, Vec<u8>);

impl<T: ProtoForm<P>, P> ProtoForm<Vec<P>> for Vec<T> {
    fn to_proto(&self) -> Vec<P> {
        self.iter().map(T::to_proto).collect()
    }
    fn from_proto(p: Vec<P>, field: &'static str) -> Result<Self, DecodeError> {
        p.into_iter().map(|x| T::from_proto(x, field)).collect()
    }
    fn version_of(p: &Vec<P>) -> u32 {
        p.iter().map(T::version_of).fold(FIRST, max)
    }
}

impl<T: Versions> Versions for Vec<T> {
    const NEWEST: u32 = T::NEWEST;
}

/// An optional field: absent stays absent (for numbers, proto3's
/// `optional`: an explicit zero stays a zero).
impl<T: ProtoForm<P>, P> ProtoForm<Option<P>> for Option<T> {
    fn to_proto(&self) -> Option<P> {
        self.as_ref().map(T::to_proto)
    }
    fn from_proto(p: Option<P>, field: &'static str) -> Result<Self, DecodeError> {
        p.map(|x| T::from_proto(x, field)).transpose()
    }
    fn version_of(p: &Option<P>) -> u32 {
        p.as_ref().map_or(FIRST, T::version_of)
    }
}

impl<T: Versions> Versions for Option<T> {
    const NEWEST: u32 = T::NEWEST;
}

/// A required message: prost holds every message field as an `Option`;
/// absent is [`DecodeError::MissingField`].
impl<T: Message + ProtoForm<P>, P> ProtoForm<Option<P>> for T {
    fn to_proto(&self) -> Option<P> {
        Some(T::to_proto(self))
    }
    fn from_proto(p: Option<P>, field: &'static str) -> Result<Self, DecodeError> {
        T::from_proto(p.ok_or(DecodeError::MissingField(field))?, field)
    }
    fn version_of(p: &Option<P>) -> u32 {
        p.as_ref().map_or(FIRST, T::version_of)
    }
}

impl<K: Clone + Ord, T: ProtoForm<P>, P> ProtoForm<BTreeMap<K, P>> for BTreeMap<K, T> {
    fn to_proto(&self) -> BTreeMap<K, P> {
        self.iter()
            .map(|(k, v)| (k.clone(), v.to_proto()))
            .collect()
    }
    fn from_proto(p: BTreeMap<K, P>, field: &'static str) -> Result<Self, DecodeError> {
        p.into_iter()
            .map(|(k, v)| Ok((k, T::from_proto(v, field)?)))
            .collect()
    }
    fn version_of(p: &BTreeMap<K, P>) -> u32 {
        p.values().map(T::version_of).fold(FIRST, max)
    }
}

impl<K, T: Versions> Versions for BTreeMap<K, T> {
    const NEWEST: u32 = T::NEWEST;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_required_message_is_an_error_naming_the_field() {
        #[derive(Debug, PartialEq)]
        struct Inner(u64);
        impl Message for Inner {}
        impl ProtoForm<u64> for Inner {
            fn to_proto(&self) -> u64 {
                self.0
            }
            fn from_proto(p: u64, _: &'static str) -> Result<Self, DecodeError> {
                Ok(Inner(p))
            }
            fn version_of(p: &u64) -> u32 {
                if *p > 9 {
                    3
                } else {
                    FIRST
                }
            }
        }
        let back: Result<Inner, _> = ProtoForm::from_proto(None::<u64>, "outer.inner");
        assert_eq!(back, Err(DecodeError::MissingField("outer.inner")));
        let optional: Option<Inner> = ProtoForm::from_proto(None::<u64>, "outer.inner").unwrap();
        assert_eq!(optional, None);
        // A list's version is its newest element's.
        assert_eq!(
            <Vec<Inner> as ProtoForm<Vec<u64>>>::version_of(&vec![1, 10, 2]),
            3
        );
        assert_eq!(
            <Vec<Inner> as ProtoForm<Vec<u64>>>::version_of(&vec![1, 2]),
            FIRST
        );
    }
}
