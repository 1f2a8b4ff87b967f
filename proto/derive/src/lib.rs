//! `#[derive(ProtoForm)]`: the conversions between one of Keel's domain
//! types and the protobuf message generated from `proto/` for it, so that
//! a field added to both is converted, checked and versioned without
//! hand-written code (ARCHITECTURE.md, "What one new field costs").
//!
//! It implements `keel_state::proto_form::ProtoForm<P>` (both directions,
//! and the entry format version the encoded value needs) and `Versions`
//! (the newest format version the type knows) for three shapes:
//!
//! - a struct with named fields, `#[proto(message = "pb::Gpu")]`: field by
//!   field, by name;
//! - an enum whose variants have named fields (or none),
//!   `#[proto(oneof = "pb::log_entry::Command", messages = "pb")]`: variant
//!   `V` is the oneof's `V`, holding the message `pb::V`;
//! - an enum of unit variants, `#[proto(enumeration = "pb::Role")]`: the
//!   protobuf enum's value of the same name, as the `i32` prost keeps; any
//!   other value (the `UNSPECIFIED` zero included) is refused on decode.
//!
//! Field (and variant) attributes:
//! - `skip`: not in the protobuf form; `Default` when decoded;
//! - `since = N`: added in entry format version `N`, so a value whose
//!   protobuf field is not its default needs version `N` (a build that
//!   reads an older version would drop it). On a variant: the variant was
//!   added in version `N`.
//!
//! Names match exactly; a field whose protobuf form is shaped otherwise
//! gets it from its type's own `ProtoForm` impl, written by hand.
//!
//! Errors name the field as `message.field` in protobuf's snake case
//! (`finish_job.outcome`). The generated code names
//! `crate::proto_form` and `crate::codec::DecodeError`, so it is for types
//! of `keel-state`.
//!
//! Hand-written because the crates made for this (`proto_convert_derive`,
//! `protobuf-convert`) panic on a missing field or an unknown enum value,
//! where a log entry read from disk or the network must be an error.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as Tokens};
use quote::quote;
use syn::{
    parse_macro_input, Attribute, Data, DeriveInput, Error, Fields, LitInt, LitStr, Path, Result,
};

#[proc_macro_derive(ProtoForm, attributes(proto))]
pub fn derive_proto_form(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input)
        .unwrap_or_else(Error::into_compile_error)
        .into()
}

/// What `#[proto(...)]` on the type says.
#[derive(Default)]
struct TypeAttrs {
    message: Option<Path>,
    oneof: Option<Path>,
    messages: Option<Path>,
    enumeration: Option<Path>,
}

/// What `#[proto(...)]` on a field or a variant says.
#[derive(Default)]
struct ItemAttrs {
    skip: bool,
    since: Option<u32>,
}

fn type_attrs(attrs: &[Attribute]) -> Result<TypeAttrs> {
    let mut out = TypeAttrs::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("proto")) {
        attr.parse_nested_meta(|meta| {
            let path = |meta: &syn::meta::ParseNestedMeta| -> Result<Path> {
                meta.value()?.parse::<LitStr>()?.parse()
            };
            if meta.path.is_ident("message") {
                out.message = Some(path(&meta)?);
            } else if meta.path.is_ident("oneof") {
                out.oneof = Some(path(&meta)?);
            } else if meta.path.is_ident("messages") {
                out.messages = Some(path(&meta)?);
            } else if meta.path.is_ident("enumeration") {
                out.enumeration = Some(path(&meta)?);
            } else {
                return Err(meta.error("expected message, oneof, messages or enumeration"));
            }
            Ok(())
        })?;
    }
    Ok(out)
}

fn item_attrs(attrs: &[Attribute]) -> Result<ItemAttrs> {
    let mut out = ItemAttrs::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("proto")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                out.skip = true;
            } else if meta.path.is_ident("since") {
                out.since = Some(meta.value()?.parse::<LitInt>()?.base10_parse()?);
            } else {
                return Err(meta.error("expected skip or since"));
            }
            Ok(())
        })?;
    }
    if out.skip && out.since.is_some() {
        return Err(Error::new(
            Span::call_site(),
            "a skipped field has no protobuf form to version",
        ));
    }
    Ok(out)
}

/// `FinishJob` → `finish_job`: protobuf's name for a message's field.
fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

fn expand(input: &DeriveInput) -> Result<Tokens> {
    let attrs = type_attrs(&input.attrs)?;
    let name = &input.ident;
    let owner = snake(&name.to_string());
    match &input.data {
        Data::Struct(data) => {
            let message = attrs.message.ok_or_else(|| {
                Error::new_spanned(name, "a struct needs #[proto(message = \"path\")]")
            })?;
            let Fields::Named(fields) = &data.fields else {
                return Err(Error::new_spanned(name, "only structs with named fields"));
            };
            let body = FieldsCode::new(fields.named.iter(), &owner)?;
            let build = &body.build;
            let read = &body.read;
            let pattern = &body.pattern;
            let version = &body.version;
            let newest = &body.newest;
            Ok(quote! {
                impl crate::proto_form::ProtoForm<#message> for #name {
                    fn to_proto(&self) -> #message {
                        let #name { #(#pattern,)* .. } = self;
                        #message { #(#build,)* }
                    }
                    fn from_proto(
                        p: #message,
                        _field: &'static str,
                    ) -> ::std::result::Result<Self, crate::codec::DecodeError> {
                        ::std::result::Result::Ok(#name { #(#read,)* })
                    }
                    fn version_of(p: &#message) -> u32 {
                        let v = crate::proto_form::FIRST;
                        #(#version)*
                        v
                    }
                }
                impl crate::proto_form::Message for #name {}
                impl crate::proto_form::Versions for #name {
                    const NEWEST: u32 = {
                        let v = crate::proto_form::FIRST;
                        #(#newest)*
                        v
                    };
                }
            })
        }
        Data::Enum(data) if attrs.enumeration.is_some() => {
            let proto = attrs.enumeration.as_ref();
            let mut to = Vec::new();
            let mut from = Vec::new();
            for variant in &data.variants {
                if !matches!(variant.fields, Fields::Unit) {
                    return Err(Error::new_spanned(
                        variant,
                        "an enumeration's variants have no fields",
                    ));
                }
                let v = &variant.ident;
                to.push(quote! { #name::#v => #proto::#v as i32 });
                from.push(quote! { ::std::result::Result::Ok(#proto::#v) => ::std::result::Result::Ok(#name::#v) });
            }
            Ok(quote! {
                impl crate::proto_form::ProtoForm<i32> for #name {
                    fn to_proto(&self) -> i32 {
                        match self { #(#to,)* }
                    }
                    fn from_proto(
                        p: i32,
                        field: &'static str,
                    ) -> ::std::result::Result<Self, crate::codec::DecodeError> {
                        match #proto::try_from(p) {
                            #(#from,)*
                            _ => ::std::result::Result::Err(
                                crate::codec::DecodeError::UnknownValue { field, value: p },
                            ),
                        }
                    }
                    fn version_of(_: &i32) -> u32 {
                        crate::proto_form::FIRST
                    }
                }
                impl crate::proto_form::Versions for #name {
                    const NEWEST: u32 = crate::proto_form::FIRST;
                }
            })
        }
        Data::Enum(data) => {
            let (Some(oneof), Some(messages)) = (&attrs.oneof, &attrs.messages) else {
                return Err(Error::new_spanned(
                    name,
                    "an enum needs #[proto(enumeration = \"path\")] or \
                     #[proto(oneof = \"path\", messages = \"path\")]",
                ));
            };
            let mut to = Vec::new();
            let mut from = Vec::new();
            let mut version = Vec::new();
            let mut newest = Vec::new();
            for variant in &data.variants {
                let v = &variant.ident;
                let vattrs = item_attrs(&variant.attrs)?;
                let owner = snake(&v.to_string());
                let named: Vec<&syn::Field> = match &variant.fields {
                    Fields::Named(f) => f.named.iter().collect(),
                    Fields::Unit => Vec::new(),
                    Fields::Unnamed(_) => {
                        return Err(Error::new_spanned(
                            variant,
                            "a oneof's variants have named fields or none",
                        ))
                    }
                };
                let body = FieldsCode::new(named.into_iter(), &owner)?;
                let build = &body.build;
                let read = &body.read;
                let pattern = &body.pattern;
                let fv = &body.version;
                let fnew = &body.newest;
                let since = vattrs.since.unwrap_or(1);
                to.push(quote! {
                    #name::#v { #(#pattern,)* .. } => #oneof::#v(#messages::#v { #(#build,)* })
                });
                from.push(quote! {
                    #oneof::#v(p) => #name::#v { #(#read,)* }
                });
                version.push(quote! {
                    #oneof::#v(p) => {
                        let v = #since;
                        #(#fv)*
                        v
                    }
                });
                newest.push(quote! {
                    let v = crate::proto_form::max(v, {
                        let v = #since;
                        #(#fnew)*
                        v
                    });
                });
            }
            Ok(quote! {
                impl crate::proto_form::ProtoForm<#oneof> for #name {
                    fn to_proto(&self) -> #oneof {
                        match self { #(#to,)* }
                    }
                    fn from_proto(
                        p: #oneof,
                        _field: &'static str,
                    ) -> ::std::result::Result<Self, crate::codec::DecodeError> {
                        ::std::result::Result::Ok(match p { #(#from,)* })
                    }
                    fn version_of(p: &#oneof) -> u32 {
                        match p { #(#version,)* }
                    }
                }
                impl crate::proto_form::Versions for #name {
                    const NEWEST: u32 = {
                        let v = crate::proto_form::FIRST;
                        #(#newest)*
                        v
                    };
                }
            })
        }
        Data::Union(_) => Err(Error::new_spanned(name, "unions have no protobuf form")),
    }
}

/// The code for one message's fields, named `p` on the protobuf side.
struct FieldsCode {
    /// `proto_field: <conversion of the domain field>`
    build: Vec<Tokens>,
    /// `domain_field: <conversion of p.proto_field>?`
    read: Vec<Tokens>,
    /// The domain fields bound by reference (skipped ones left out).
    pattern: Vec<Tokens>,
    /// Statements raising `v` to the version `p`'s fields need.
    version: Vec<Tokens>,
    /// Statements raising `v` to the newest version the fields know.
    newest: Vec<Tokens>,
}

impl FieldsCode {
    fn new<'a>(fields: impl Iterator<Item = &'a syn::Field>, owner: &str) -> Result<FieldsCode> {
        let mut code = FieldsCode {
            build: Vec::new(),
            read: Vec::new(),
            pattern: Vec::new(),
            version: Vec::new(),
            newest: Vec::new(),
        };
        for field in fields {
            let Some(ident) = &field.ident else {
                return Err(Error::new_spanned(field, "a named field"));
            };
            let attrs = item_attrs(&field.attrs)?;
            if attrs.skip {
                code.read
                    .push(quote! { #ident: ::std::default::Default::default() });
                continue;
            }
            let ty = &field.ty;
            let proto = ident;
            let path = format!("{owner}.{ident}");
            code.pattern.push(quote! { #ident });
            code.build
                .push(quote! { #proto: crate::proto_form::ProtoForm::to_proto(#ident) });
            code.read.push(quote! {
                #ident: crate::proto_form::ProtoForm::from_proto(p.#proto, #path)?
            });
            code.version.push(quote! {
                let v = crate::proto_form::max(
                    v,
                    <#ty as crate::proto_form::ProtoForm<_>>::version_of(&p.#proto),
                );
            });
            code.newest.push(quote! {
                let v = crate::proto_form::max(
                    v,
                    <#ty as crate::proto_form::Versions>::NEWEST,
                );
            });
            if let Some(since) = attrs.since {
                code.version.push(quote! {
                    let v = if crate::proto_form::is_default(&p.#proto) {
                        v
                    } else {
                        crate::proto_form::max(v, #since)
                    };
                });
                code.newest
                    .push(quote! { let v = crate::proto_form::max(v, #since); });
            }
        }
        Ok(code)
    }
}

#[cfg(test)]
mod tests {
    use super::snake;

    #[test]
    fn a_message_is_named_in_protobufs_snake_case() {
        assert_eq!(snake("FinishJob"), "finish_job");
        assert_eq!(snake("RecordNodeInventory"), "record_node_inventory");
        assert_eq!(snake("Gpu"), "gpu");
    }
}
